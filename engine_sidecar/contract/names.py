"""Every name two KVQuota processes must agree on: each is defined here only.

The operator renders and injects with these, the sidecar serves and tags with them,
the plugin reads them inside vLLM; a rename here is a rename everywhere.
"""

from __future__ import annotations

from typing import Literal, get_args

# -- the API ------------------------------------------------------------------------------
GROUP = "kvquota.dev"
VERSION = "v1alpha1"
ApiVersion = Literal["kvquota.dev/v1alpha1"]  # the CRs' and the EnginePolicy's apiVersion
API_VERSION: ApiVersion = get_args(ApiVersion)[0]

# -- the policy: ConfigMap (operator -> sidecar) and file (sidecar -> plugin) ------------
POLICY_FILE = "policy.json"  # the ConfigMap's key, and the file's name on the shared volume
POLICY_CONFIGMAP_SUFFIX = "-kvquota-policy"  # <pool>-kvquota-policy, in the pool's namespace
POOL_LABEL = f"{GROUP}/pool"  # on engine pods: the pool they serve (operator, sidecar env)
STATS_FILE = "stats.json"  # what the plugin publishes, beside the policy file
POLICY_PATH_ENV = "KVQUOTA_POLICY_PATH"  # both containers: where the policy file is
STATS_PATH_ENV = "KVQUOTA_STATS_PATH"  # both containers: where the plugin's stats are
# The engine's pod name, in both containers: the sidecar names it in the lease-engine
# header; both pick their entry of the policy's per-engine split by it.
ENGINE_NAME_ENV = "POD_NAME"
# The engine pod's namespace, in the sidecar: with the pod name, the pod a picker's
# session token names (`<namespace>/<name>`).
ENGINE_NAMESPACE_ENV = "POD_NAMESPACE"
HEARTBEAT_S = 0.5  # the plugin rewrites its stats file at least this often
STALE_AFTER_S = max(2.0, 10 * HEARTBEAT_S)  # ten missed rewrites: nobody is writing

# -- per request (sidecar -> plugin): vLLM's `extra_args` keys ----------------------------
TENANT_ARG = "kvq_tenant"
SESSION_ARG = "kvq_session"
# The blocks the sidecar reserved for one sequence of the request (prompt + its output
# estimate, README: reservations): a victim holding more had outgrown its estimate.
RESERVED_BLOCKS_ARG = "kvq_reserved_blocks"
# The output tokens the sidecar reserved for one sequence of the request. A request
# admitted on its prompt's ceiling, before its prompt was counted, has its
# RESERVED_BLOCKS_ARG taken at that ceiling; with this, the plugin takes what was
# reserved at the prompt's exact length (its own count) instead.
RESERVED_OUTPUT_ARG = "kvq_reserved_output_tokens"
# Present (true) on a request admitted beyond its tenant's maxBlocks into idle KV
# (aboveMax: Reclaimable): the plugin ranks it the first victim after unclassified work.
ABOVE_MAX_ARG = "kvq_above_max"
UNCLASSIFIED = "_unclassified"  # the stats key of traffic with no tenant the policy knows

# -- the sidecar's admin port (operator -> sidecar) ---------------------------------------
STATUS_ROUTE = "/kvquota/status"
ADMIN_PORT = 9100  # status, metrics, probes; never the client port
ADMIN_PORT_NAME = "admin"  # its container port name in the engine pod

# -- the engine's API key (injection -> vLLM and sidecar) ---------------------------------
ENGINE_KEY_ENV = "VLLM_API_KEY"  # read by vLLM and by the sidecar
ENGINE_KEY_FILE_ENV = "KVQUOTA_ENGINE_API_KEY_FILE"

# -- the perf harness (lab -> sidecar) -----------------------------------------------------
# A file the sidecar rewrites with its event loop's lag and GC pauses (off when unset).
PAUSE_PROBE_ENV = "KVQUOTA_PAUSE_PROBE"

# -- the plugin (injection -> vLLM) --------------------------------------------------------
PLUGIN_CLASS = "engine_sidecar.plugin.scheduler.TenantAwareScheduler"  # --scheduler-cls
PREFLIGHT_MODULE = "engine_sidecar.plugin.preflight"  # `python -m` it in the engine's image
PREFLIGHT_STRICT_FLAG = "--strict"
