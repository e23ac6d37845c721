"""The engine policy the sidecar enforces, and where it comes from."""
