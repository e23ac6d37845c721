"""KVQuota: the operator, the `kvquota` CLI and the tools around it.

Imports `engine_sidecar` (the engine contract), never the reverse.
"""

GROUP = "kvquota.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
