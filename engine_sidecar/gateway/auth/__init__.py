"""Who is calling (JWT, anonymous, trusted header), and the engine's own API key."""
