"""Whether an authenticated, counted request runs now, waits, or is refused."""
