"""`kvquota bench`: stock vLLM FCFS, stock priority and KVQuota side by side.

Backends: `twin` (vLLM's real scheduler and KV cache manager on virtual time, see
`twin.py`) and `engine` (the real vLLM CPU server, through the sidecar for KVQuota,
see `engine_backend.py`). Scenarios are YAML (`scenario.py`, `README.md`).
"""
