"""KVQuota: the operator, the `kvquota` CLI and the tools around it.

Imports `engine_sidecar` (the engine contract), never the reverse.
"""

__version__ = "0.1.0"
GROUP = "kvquota.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
