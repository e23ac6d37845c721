"""The tenant rules the plugin applies, on plain values: no vLLM, no engine.

Identity, leases and their caps, session pauses, the victim order's keys, counters
and degraded-mode episodes: each is a small object tested on its own
(tests/plugin/test_tenant_parts.py).
"""
