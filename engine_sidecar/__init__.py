"""Engine side of KVQuota, in three parts that import in one direction:

- `contract/`: what operator, sidecar and plugin agree on (names, wire models, the
  admission rule, the shared files); imported by all three;
- `plugin/`: the scheduler plugin inside vLLM (`kvquota install-plugin` copies only
  `contract/` and `plugin/` into the engine's container);
- `gateway/`: the admission sidecar (`kvquota sidecar`, `cli.py`).

Nothing here imports the operator (`kvquota`).
"""
