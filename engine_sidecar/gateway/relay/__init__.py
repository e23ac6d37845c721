"""An admitted request to the engine and its answer back; vLLM's other routes."""
