"""0.1.0's path of the scheduler plugin, kept until 0.4.0: manifests injected by 0.1.0
start vLLM with `--scheduler-cls engine_sidecar.scheduler.TenantAwareScheduler`.
Importing it warns once, naming `engine_sidecar.plugin.scheduler`."""

from engine_sidecar.contract.renamed import warn_renamed
from engine_sidecar.plugin.scheduler import TenantAwareScheduler

__all__ = ["TenantAwareScheduler"]

warn_renamed("engine_sidecar.scheduler.TenantAwareScheduler")
