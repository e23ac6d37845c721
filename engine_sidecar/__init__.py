"""Engine side of KVQuota, in three parts that import in one direction:

- `contract/`: what operator, sidecar and plugin agree on (names, wire models, the
  admission rule, the shared files); imported by all three;
- `plugin/`: the scheduler plugin inside vLLM (`kvquota install-plugin` copies only
  `contract/`, `plugin/` and the old paths below into the engine's container);
- `gateway/`: the admission sidecar (`kvquota sidecar`, `cli.py`).

`scheduler.py`, `preflight.py` and `policy.py` at the top are 0.1.0's paths, which
older manifests and code still name: each warns and hands over to its new home until
0.4.0 (`contract/renamed.py`); install-plugin copies them with the plugin.

Nothing here imports the operator (`kvquota`).
"""
