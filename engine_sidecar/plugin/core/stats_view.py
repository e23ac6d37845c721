"""The plugin's stats as of now: per tenant, what runs, waits, is leased and was lost.

Blocks are counted as vLLM holds them: a prefix shared by several requests or leases
of a tenant counts once. Built on the engine thread; `stats_publisher` writes it out.
"""

from __future__ import annotations

import time

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.plugin.core.engine_port import Engine, EngineFacts, Phase
from engine_sidecar.plugin.core.offload import OffloadAccounting
from engine_sidecar.plugin.core.tenant_state import TenantState
from engine_sidecar.plugin.core.victim_order import VictimOrder
from engine_sidecar.plugin.rules.counters import stats_tenant
from engine_sidecar.plugin.stats_publisher import LeaseView, StatsSnapshot

_WAITING = (Phase.QUEUED, Phase.PENDING)


class StatsView:
    def __init__(self, state: TenantState, engine: Engine, victims: VictimOrder,
                 offload: OffloadAccounting, facts: EngineFacts) -> None:
        self._state = state
        self._engine = engine
        self._victims = victims
        self._offload = offload
        self._facts = facts

    def snapshot(self) -> StatsSnapshot:
        """Everything the stats file reports, as of now (call from the engine thread)."""
        state, engine = self._state, self._engine
        policy = state.policy
        tenants = {tenant: TenantEngineStats() for tenant in (policy.tenants if policy else ())}

        def entry(key: str) -> TenantEngineStats:
            stats = tenants.get(key)
            if stats is None:
                stats = tenants[key] = TenantEngineStats()
            return stats

        entries, held, shared = engine.scan_running(
            state.ids, policy.tenants if policy is not None else {}, self._victims.marked
        )
        for _, _, tenant, *_ in entries:
            entry(tenant or UNCLASSIFIED).running += 1
        for tenant, num_blocks in held.items():
            entry(tenant or UNCLASSIFIED).running_blocks += num_blocks
        for tenant, block_ids in shared.items():
            entry(tenant or UNCLASSIFIED).running_blocks += len(block_ids)
        for request in engine.all_requests():
            if engine.phase(request) in _WAITING:
                tenant = state.identity(engine.facts(request).req_id).tenant
                entry(stats_tenant(policy, tenant)).waiting += 1

        running_shared: set[int] = set().union(*shared.values())
        counted: dict[str, set[int]] = {}
        pinned: dict[str, set[int]] = {}  # per tenant: ids of lease blocks with refcount > 1
        idle_so_far: dict[str, float] = {}  # block-seconds of live leases of idle sessions
        now = state.clock()
        views: list[LeaseView] = []
        for lease in state.leases:
            key = stats_tenant(policy, lease.tenant)
            own = engine.count_lease_only_blocks(
                lease.blocks, running_shared, counted.setdefault(key, set())
            )
            stats = entry(key)
            stats.leased_sessions += 1
            stats.leased_blocks += own
            if lease.key not in state.active:
                idle_so_far[key] = idle_so_far.get(key, 0.0) + lease.num_blocks * max(
                    0.0, now - lease.last_activity
                )
            stats.leases[lease.session] = lease.num_blocks
            stats.pinned_blocks += engine.count_unshared_blocks(
                lease.blocks, pinned.setdefault(key, set())
            )
            views.append(LeaseView(key, lease.session, lease.last_activity, lease.expires_at,
                                   own))
        for key, block_ids in pinned.items():
            entry(key).pinned_blocks += len(block_ids)
        for req_id, num_blocks in self._offload.swapped():
            tenant = state.identity(req_id).tenant
            entry(stats_tenant(policy, tenant)).swapped_blocks += num_blocks

        for key, counters in state.counters.tenants.items():
            stats = entry(key)
            stats.preemptions = dict(counters.preemptions)
            stats.outgrown_preemptions = counters.outgrown_preemptions
            stats.lease_breaks = counters.lease_breaks
            stats.lease_drops = dict(counters.lease_drops)
            stats.degraded_events = counters.degraded_events
            stats.prefix_hit_tokens = counters.prefix_hit_tokens
            stats.prompt_tokens = counters.prompt_tokens
            stats.idle_lease_block_seconds = counters.idle_lease_block_seconds
        for key, seconds in idle_so_far.items():
            entry(key).idle_lease_block_seconds += seconds
        for stats in tenants.values():
            stats.idle_lease_block_seconds = round(stats.idle_lease_block_seconds, 3)

        engine_stats = EngineStats(
            timestamp=time.time(),
            policy_version=state.watcher.version,
            policy_error=state.watcher.error,
            total_blocks=self._facts.num_blocks,
            free_blocks=engine.free_block_count(),
            preemption_mode=self._offload.mode,
            degraded=state.degraded.active,
            degraded_episodes=state.degraded.episodes,
            preemptions_by_mode=dict(self._offload.modes),
            vllm_version=self._facts.vllm_version,
            tenants=tenants,
        )
        return StatsSnapshot(engine_stats, tuple(views))
