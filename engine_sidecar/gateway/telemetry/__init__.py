"""What the sidecar tells Prometheus, tracing, the operator and endpoint pickers."""
