"""KVQuota: the operator and the `kvquota` CLI.

Imports `engine_sidecar.contract` (the API version and every cross-process name, the
EnginePolicy it renders), never the reverse.
"""

__version__ = "0.2.0"
