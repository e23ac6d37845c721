"""What the operator, the sidecar and the scheduler plugin agree on, defined once.

- `names`: every cross-process name (API version, xargs keys, env vars, file names,
  ports, the plugin's class path, the policy ConfigMap);
- `policy`: `EnginePolicy`, rendered by the operator, applied by sidecar and plugin;
- `stats`: what the plugin publishes and the sidecar serves to the operator;
- `reclaim`: the victim order read the other way, which the sidecar admits by;
- `files`: the atomic write and the change signature both sides use on shared files;
- `listen`: the HOST:PORT form of every process's listen flags.

Imports nothing of the operator, the gateway or the plugin, and no vLLM.
"""
