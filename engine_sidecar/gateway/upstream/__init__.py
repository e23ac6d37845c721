"""The HTTP clients to the engine, and whether it is answering."""
