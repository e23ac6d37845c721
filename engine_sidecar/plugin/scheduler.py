"""TenantAwareScheduler: vLLM V1's scheduler with per-tenant KV-cache quotas.

Load it in vLLM's OpenAI server with::

    vllm serve MODEL --scheduling-policy priority \\
        --scheduler-cls engine_sidecar.plugin.scheduler.TenantAwareScheduler

It runs in vLLM's EngineCore process, reads the EnginePolicy the sidecar writes
(`KVQUOTA_POLICY_PATH`) and publishes its stats (`KVQUOTA_STATS_PATH`). This class
only overrides the scheduler methods the plugin hooks; each translates vLLM's objects
and hands them to `tenant_plugin.TenantPlugin`. What the plugin does is in README
("The scheduler plugin"); every private vLLM touchpoint is in `vllm_compat`,
`vllm_engine` and `allocation_hook`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.plugin import vllm_compat as compat
from engine_sidecar.plugin.allocation_hook import HookedKVCacheManager
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.core.tenant_plugin import TenantPlugin
from engine_sidecar.plugin.stats_publisher import StatsSnapshot
from engine_sidecar.plugin.vllm_engine import VllmEngine

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class TenantAwareScheduler(compat.Scheduler):
    """vLLM's Scheduler plus tenant leases, victim order and degraded mode.

    `plugin_config` is for whoever builds the scheduler directly (the twin, tests);
    vLLM builds it without, and the plugin then reads its files from the environment.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TenantAwareScheduler:
        # With async scheduling on, vLLM needs AsyncScheduler's bookkeeping.
        if cls is TenantAwareScheduler and compat.async_scheduling_enabled(
            compat.find_vllm_config(args, kwargs)
        ):
            cls = AsyncTenantAwareScheduler
        return super().__new__(cls)

    def __init__(
        self, *args: Any, plugin_config: PluginConfig | None = None, **kwargs: Any
    ) -> None:
        compat.check_supported_vllm()
        super().__init__(*args, **kwargs)
        compat.route_logs("engine_sidecar")
        steer_victims = compat.uses_priority_policy(self)
        connector = compat.kv_connector(self)
        offloading = connector is not None and compat.offloading_configured(self.vllm_config)
        if not steer_victims:
            logger.warning(
                "KVQuota: --scheduling-policy is not 'priority'; leases apply but vLLM "
                "keeps its FCFS victim order"
            )
        engine = VllmEngine(self)
        plugin = self._kvq = TenantPlugin(
            engine, plugin_config or PluginConfig.from_env(),
            engine.engine_facts(steer_victims=steer_victims, offloading=offloading,
                                vllm_version=compat.installed_vllm_version()),
        )
        if offloading:
            compat.steer_kv_loads(connector, plugin.offload.recompute, plugin.offload.on_kv_load)
        HookedKVCacheManager.adopt(self.kv_cache_manager, plugin.reclaim.on_allocation_failure)
        watcher = plugin.state.watcher
        logger.info(
            "KVQuota TenantAwareScheduler on vLLM %s: policy %s (%s), stats %s, "
            "preemption mode %s",
            compat.installed_vllm_version(), watcher.path, watcher.version or "none",
            plugin.publisher.path if plugin.publisher else None, plugin.offload.mode,
        )

    # -- vLLM scheduler hooks -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._kvq.request_added(request)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        plugin = self._kvq
        plugin.step_starting()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            plugin.step_ended()
        plugin.step_scheduled(compat.new_request_hits(output))
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._kvq_maybe_idle()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> list[Request]:
        finished = super().finish_requests(*args, **kwargs)
        self._kvq_maybe_idle()
        return finished

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._kvq.prefix_cache_resetting()
        return bool(super().reset_prefix_cache(*args, **kwargs))

    def shutdown(self) -> None:
        self._kvq.shutdown()
        super().shutdown()

    def _free_blocks(self, request: Request) -> None:
        freed = self._kvq.request_finishing(request)
        super()._free_blocks(request)
        self._kvq.request_freed(freed)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self._kvq.preempting(request)
        super()._preempt_request(request, *args, **kwargs)

    def _kvq_maybe_idle(self) -> None:
        # vLLM's own tests build bare schedulers with object.__new__: without plugin
        # state, behave exactly like vLLM's.
        plugin: TenantPlugin | None = getattr(self, "_kvq", None)
        if plugin is not None:
            plugin.maybe_idle()

    # -- what the plugin reports ------------------------------------------------------------

    @property
    def kvq_policy_version(self) -> str | None:
        return self._kvq.state.watcher.version

    @property
    def kvq_policy(self) -> EnginePolicy | None:
        """The policy this engine enforces: its entry of the per-engine split."""
        return self._kvq.state.policy

    def kvq_snapshot(self) -> StatsSnapshot:
        """Everything the stats file reports, as of now (call from the engine thread)."""
        return self._kvq.snapshot()

    def kvq_stats(self) -> EngineStats:
        """The stats as the file would show them now."""
        return self._kvq.render_stats()


class AsyncTenantAwareScheduler(TenantAwareScheduler, compat.AsyncScheduler):
    """Chosen automatically when vLLM runs with async scheduling."""
