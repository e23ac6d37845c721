"""TenantAwareScheduler: vLLM V1's scheduler with per-tenant KV-cache quotas.

Load it in vLLM's OpenAI server with::

    vllm serve MODEL --scheduling-policy priority \\
        --scheduler-cls engine_sidecar.plugin.scheduler.TenantAwareScheduler

It runs in vLLM's EngineCore process and reads two environment variables:

- `KVQUOTA_POLICY_PATH`: the EnginePolicy JSON the sidecar writes (atomically). It is
  checked at most every 0.5 s and applied between steps; a bad file keeps the last
  good policy (logged once, shown as `policyError`). No file: every request is
  unclassified and the plugin picks the same victims as vLLM's priority policy.
- `KVQUOTA_STATS_PATH`: where the plugin publishes `engine_sidecar.contract.stats.EngineStats`
  as JSON, replaced atomically every 0.25 s while the engine steps and every 0.5 s
  while it idles (see `engine_sidecar.plugin.stats_publisher`). That file is the plugin's only
  channel: the sidecar reads it and exports the Prometheus families
  `vllm_tenant_kv_cache_evictions_total{tenant_id,priority,preemption_reason}`,
  `vllm_tenant_active_swapped_blocks{tenant_id}` and `kvquota_*`, so the EngineCore
  process runs no metrics server of its own.

What the plugin adds to vLLM's scheduler:

- identity: `kvq_tenant` / `kvq_session` from `sampling_params.extra_args` (the
  sidecar sets them through `vllm_xargs`); requests without a tenant known to the
  policy are unclassified and the first to give blocks back;
- leases: when a request of a tenant with `lease.seconds > 0` finishes, the session's
  prefix-cached blocks keep one extra reference (pinned) until `lease.seconds` after
  the session's last activity, within `lease.maxSessions` / `lease.maxBlocks`; the
  next turn of the session is a prefix-cache hit. Expired leases go back to vLLM's
  LRU. Pinned blocks count as the tenant's usage;
- victim order: the total order documented in `engine_sidecar.plugin.tenant_policy`,
  applied whenever vLLM fails to allocate, for waiting requests too: the sidecar admits
  a request counting the free blocks above the watermark plus every block this order
  gives back before the request's own class, and the plugin makes that true by
  preempting the running work ranked above a waiting request that found no room.
  vLLM's priority policy preempts `max(running, key=(priority, arrival_time))`; the
  plugin gives its chosen victim the top priority value for that instant and restores
  it before the request re-enters the waiting heap (no request's priority changes
  while it is in the heap);
- leases last a few of the session's own pauses (`tenant_policy.SessionPauses`), at
  most `lease.seconds`;
- prefill order: while a higher-priority request prefills or waits to be admitted,
  lower-priority prefill chunks sit out the step;
- retention order: once vLLM evicts cached blocks younger than the leased tenants'
  typical pause, the cache of tenants without leases is evicted first;
- degraded mode: when nothing ranks above the request that needs blocks in the
  victim order and no other request is running, live leases are released (oldest
  premium last) so the engine always makes progress; counted, logged once per
  episode, exposed;
- preemption mode: vLLM V1 has no swap; a preempted request either recomputes its
  KV or, when the engine runs a KV offloading connector (`kv_offloading_size`, the
  OffloadingConnector or LMCache), reloads what the connector stored. The plugin
  honours the policy's `recomputeBelowBlocks`: a victim that held fewer blocks
  recomputes (the connector's hit is declined, see `vllm_compat.steer_kv_loads`);
  larger victims are left to the connector and show as `swappedBlocks` while they
  wait. `preemptionsByMode` reports what happened: without offloading every
  preemption counts as `recompute`; with it, a victim counts when it resumes, as
  `offload` if its KV came back from the connector, else `recompute`.

All vLLM private-API access goes through `engine_sidecar.plugin.vllm_compat`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.reclaim import requester_band
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.plugin import vllm_compat as compat
from engine_sidecar.plugin.allocation_hook import HookedKVCacheManager
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.policy_watch import PolicyWatcher
from engine_sidecar.plugin.stats_publisher import (
    STEP_INTERVAL_S,
    LeaseView,
    StatsPublisher,
    StatsSnapshot,
)
from engine_sidecar.plugin.tenant_policy import (
    NO_IDENTITY,
    CounterBook,
    DegradedEpisodes,
    Identity,
    Lease,
    LeaseDrop,
    LeaseTable,
    RankKey,
    Reason,
    RetentionOrder,
    SessionPauses,
    VictimRanker,
    identity_from_extra_args,
    lease_block_cap,
    lease_seconds,
    outgrew,
    stats_tenant,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# (request, tenant known to the policy or None, priority, computed tokens, arrival)
_RunningEntry = compat.RunningEntry


class _StepView:
    """Ranking state for one step; the victim order is sorted lazily."""

    def __init__(self, ranker: VictimRanker, entries: list[_RunningEntry]) -> None:
        self.ranker = ranker
        self.entries = entries
        self.keys: list[RankKey] = []  # each entry's running key, set with `order`
        self.order: list[int] | None = None  # entry indices, next victim first
        self.next = 0

    def debit(self, tenant: str | None, num_blocks: int) -> None:
        if self.ranker.debit(tenant, num_blocks):
            self.order = None  # a tenant stopped borrowing: its keys changed


class TenantAwareScheduler(compat.Scheduler):
    """vLLM's Scheduler plus tenant leases, victim order and degraded mode."""

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
        config = plugin_config or PluginConfig.from_env()
        self._kvq_clock: Callable[[], float] = config.clock
        self._kvq_ranker_cls = config.ranker
        self._kvq_ids: dict[str, Identity] = {}
        # Sessions with a request in the engine: their lease is not idle.
        self._kvq_active: Counter[tuple[str, str]] = Counter()
        self._kvq_leases: LeaseTable[KVCacheBlock] = LeaseTable(compat.block_id)
        self._kvq_pauses = SessionPauses()
        # A waiting request that found no room in the last step, the key it ranks with
        # and the free blocks it needed: running work ranked above it is preempted
        # before the next step (see _kvq_reclaim_for_waiting).
        self._kvq_starved: tuple[Request, RankKey, int] | None = None
        self._kvq_stuck: Request | None = None  # reclaim could not make room for it
        self._kvq_retention = RetentionOrder()
        self._kvq_protect_s = 0.0  # RetentionOrder's protect_s; 0: no tenant has leases
        self._kvq_protect_until = 0.0  # when to recompute it (pauses move slowly)
        self._kvq_counters = CounterBook()
        self._kvq_modes: Counter[str] = Counter()
        # With KV offloading: preempted requests not yet resumed (req_id -> blocks they
        # held), and those of them that must recompute rather than reload.
        self._kvq_preempted: dict[str, int] = {}
        self._kvq_recompute: set[str] = set()
        self._kvq_degraded = DegradedEpisodes()
        # req_id -> (request, priority to restore); only requests in `running`.
        self._kvq_marked: dict[str, tuple[Request, int]] = {}
        self._kvq_view: _StepView | None = None  # built at a step's first allocation failure
        self._kvq_alloc_failed = False
        self._kvq_in_step = False
        self._kvq_steer_victims = compat.uses_priority_policy(self)
        connector = compat.kv_connector(self)
        self._kvq_offloading = connector is not None and compat.offloading_configured(
            self.vllm_config
        )
        if self._kvq_offloading:
            compat.steer_kv_loads(connector, self._kvq_recompute, self._kvq_on_kv_load)
        self._kvq_next_publish = 0.0
        HookedKVCacheManager.adopt(self.kv_cache_manager, self._kvq_on_alloc_failure)
        if not self._kvq_steer_victims:
            logger.warning(
                "KVQuota: --scheduling-policy is not 'priority'; leases apply but vLLM "
                "keeps its FCFS victim order"
            )
        self._kvq_watcher = PolicyWatcher(config.policy_path, clock=self._kvq_now,
                                          engine=config.engine)
        self._kvq_watcher.poll(force=True)
        self._kvq_apply_policy()
        self._kvq_publisher: StatsPublisher | None = None
        if config.stats_path:
            self._kvq_publisher = StatsPublisher(
                config.stats_path, policy_path=self._kvq_watcher.path, clock=self._kvq_now
            )
            self._kvq_publish(self._kvq_clock())  # readers see the engine before a step
        logger.info(
            "KVQuota TenantAwareScheduler on vLLM %s: policy %s (%s), stats %s, "
            "preemption mode %s",
            compat.installed_vllm_version(),
            self._kvq_watcher.path, self._kvq_watcher.version or "none",
            self._kvq_publisher.path if self._kvq_publisher else None,
            self._kvq_preemption_mode,
        )

    def _kvq_now(self) -> float:
        return self._kvq_clock()

    @property
    def kvq_policy_version(self) -> str | None:
        return self._kvq_watcher.version

    @property
    def _kvq_preemption_mode(self) -> str:
        return "offload" if self._kvq_offloading else "recompute"

    # -- vLLM scheduler hooks -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        req_id = compat.request_id(request)
        if compat.get_request(self, req_id) is None:
            identity = identity_from_extra_args(compat.request_extra_args(request))
            if identity is not NO_IDENTITY:
                self._kvq_ids[req_id] = identity
                key = identity.session_key
                if key is not None:
                    now = self._kvq_clock()
                    self._kvq_active[key] += 1
                    self._kvq_pauses.turn_started(key, now)
                    seconds = lease_seconds(self._kvq_watcher.policy, identity.tenant)
                    self._kvq_leases.touch(key, now, seconds)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        now = self._kvq_clock()
        if self._kvq_watcher.poll():
            self._kvq_apply_policy()
        if len(self._kvq_leases):
            self._kvq_release_expired(now)
        self._kvq_in_step = True
        try:
            if self._kvq_starved is not None:
                self._kvq_reclaim_for_waiting()
            if self._kvq_steer_victims and self._kvq_watcher.policy is not None:
                self._kvq_prioritize_prefills()
            output = super().schedule(*args, **kwargs)
        finally:
            self._kvq_in_step = False
            self._kvq_end_step()
        self._kvq_record_hits(output)
        if self._kvq_publisher is not None and now >= self._kvq_next_publish:
            self._kvq_publish(now)
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
        # vLLM resets only when every block is free: pinned blocks must go first.
        for lease in self._kvq_leases.pop_all():
            self._kvq_unpin(lease, LeaseDrop.RESET)
        return bool(super().reset_prefix_cache(*args, **kwargs))

    def shutdown(self) -> None:
        if self._kvq_publisher is not None:
            self._kvq_publisher.close(self.kvq_snapshot())
            self._kvq_publisher = None
        super().shutdown()

    def _free_blocks(self, request: Request) -> None:
        # Lease before vLLM drops the request's references: the blocks never reach
        # refcount 0, so nothing can evict them in between.
        req_id = compat.request_id(request)
        if self._kvq_preempted:
            self._kvq_forget_preempted(req_id)  # finished (e.g. aborted) before resuming
        identity = self._kvq_ids.pop(req_id, NO_IDENTITY)
        key = identity.session_key
        if key is not None:
            self._kvq_active[key] -= 1
            if self._kvq_active[key] <= 0:
                del self._kvq_active[key]
                self._kvq_pauses.turn_ended(key, self._kvq_clock())
            seconds = lease_seconds(self._kvq_watcher.policy, identity.tenant)
            if seconds > 0 and compat.kv_is_reusable(request):
                self._kvq_take_lease(key, req_id, seconds)
        blocks = compat.request_blocks(self, req_id)
        super()._free_blocks(request)
        now = self._kvq_clock()
        if self._kvq_evict_first(identity.tenant, now):
            compat.evict_first(self, reversed(blocks))
        self._kvq_retention.freed(map(compat.block_id, blocks), now)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        req_id = compat.request_id(request)
        mark = self._kvq_marked.pop(req_id, None)
        if mark is not None:
            compat.restore_priority(request, mark[1])
        if self._kvq_in_step:  # vLLM ran out of blocks (not a prefix-cache reset)
            self._kvq_count_preemption(request)
        super()._preempt_request(request, *args, **kwargs)

    # -- allocation failure: leases, victim order, degraded mode ---------------------------

    def _kvq_on_alloc_failure(
        self,
        request: Request,
        retry: Callable[[], KVCacheBlocks | None],
        shortfall: Callable[[], int],
    ) -> KVCacheBlocks | None:
        self._kvq_alloc_failed = True
        has_leases = bool(len(self._kvq_leases))
        if self._kvq_watcher.policy is None and not has_leases:
            return None  # nothing to add to vLLM's own choice
        if has_leases and self._kvq_release_expired(self._kvq_clock()):
            blocks = retry()
            if blocks is not None:
                return blocks
        requester_running = compat.is_running(request)
        view = self._kvq_get_view()
        req_id = compat.request_id(request)
        identity = self._kvq_ids.get(req_id, NO_IDENTITY)
        own_session = identity.session_key
        victim: Request | None = None
        waiting_bound: RankKey | None = None
        while True:
            if requester_running:
                victim, bound = self._kvq_pick_victim(view)
            else:
                if waiting_bound is None:
                    need = shortfall() + compat.free_block_count(self)
                    waiting_bound = self._kvq_waiting_key(view, request, need)
                bound = waiting_bound
            lease = self._kvq_best_lease(view.ranker, bound, own_session, idle_only=True)
            if lease is None:
                break
            self._kvq_release(lease, Reason.LEASE_BREAK, view)
            blocks = retry()
            if blocks is not None:
                return blocks
        if victim is not None and victim is not request:
            self._kvq_mark(victim)
            return None
        if waiting_bound is not None:
            if self._kvq_steer_victims and self._kvq_ranks_above(view, waiting_bound):
                # vLLM never preempts running work for a waiting request; the plugin
                # does, for running work ranked above it, before the next step.
                self._kvq_starved = (request, waiting_bound, shortfall())
                return None
            # Nothing else ranks above this new request: its own tenant's idle leases
            # make way for it (a tenant's cache never stands in its own way).
            while (lease := self._kvq_best_lease(
                view.ranker, None, own_session, idle_only=True, tenant=identity.tenant
            )) is not None:
                self._kvq_release(lease, Reason.LEASE_BREAK, view)
                blocks = retry()
                if blocks is not None:
                    return blocks
        # Nothing ranks below the requester. If no other request runs either, waiting
        # would stall the engine until leases expire: degraded mode.
        num_others = len(compat.running_requests(self)) - (1 if requester_running else 0)
        if num_others <= 0:
            while (lease := self._kvq_best_lease(view.ranker, None, own_session)) is not None:
                self._kvq_release(lease, Reason.DEGRADED, view)
                blocks = retry()
                if blocks is not None:
                    return blocks
        if requester_running:
            self._kvq_mark(request)
        return None

    def _kvq_get_view(self) -> _StepView:
        """The step's view of running work, built at the first allocation failure.

        One pass over `running`: each request's tenant and rank inputs, and every
        tenant's usage in distinct blocks (running + pinned). A block with refcount 1
        has a single holder, so only shared blocks (a prefix) go through a set."""
        view = self._kvq_view
        if view is not None:
            return view
        policy = self._kvq_watcher.policy
        entries, scanned, scanned_shared = compat.scan_running(
            self, self._kvq_ids, policy.tenants if policy is not None else {}, self._kvq_marked
        )
        # Unclassified work (key None) has no quota to rank against.
        usage = {tenant: n for tenant, n in scanned.items() if tenant is not None}
        shared = {tenant: ids for tenant, ids in scanned_shared.items() if tenant is not None}
        for lease in self._kvq_leases:
            lease_shared = shared.setdefault(lease.tenant, set())
            held = compat.count_unshared_blocks(lease.blocks, lease_shared)
            usage[lease.tenant] = usage.get(lease.tenant, 0) + held
        for tenant, block_ids in shared.items():
            usage[tenant] = usage.get(tenant, 0) + len(block_ids)
        view = self._kvq_view = _StepView(self._kvq_ranker_cls(policy, usage), entries)
        return view

    def _kvq_running_key(self, ranker: VictimRanker, request: Request) -> RankKey:
        req_id, priority, num_computed_tokens, arrival_time = compat.rank_inputs(request)
        mark = self._kvq_marked.get(req_id)
        if mark is not None:
            priority = mark[1]
        identity = self._kvq_ids.get(req_id, NO_IDENTITY)
        return ranker.running_key(identity.tenant, priority, num_computed_tokens, arrival_time,
                                  identity.above_max)

    def _kvq_waiting_key(self, view: _StepView, request: Request, need: int) -> RankKey:
        """The key a waiting request ranks with: as a running request that has computed
        nothing, in the band its tenant would be in once it holds the `need` blocks
        (its own idle leases left out: they yield to it)."""
        req_id, priority, _, arrival_time = compat.rank_inputs(request)
        identity = self._kvq_ids.get(req_id, NO_IDENTITY)
        tenant = identity.tenant
        ranker = view.ranker
        tenant_policy = ranker.tenant_policy(tenant)
        if tenant_policy is None:
            return ranker.running_key(tenant, priority, 0, arrival_time)
        idle = sum(
            lease.num_blocks for lease in self._kvq_leases
            if lease.tenant == tenant and lease.key not in self._kvq_active
        )
        used = max(0, ranker.usage.get(tenant_policy.tenant_id, 0) - idle)
        band = requester_band(used, need, tenant_policy.guaranteed_blocks,
                              tenant_policy.ceiling if identity.above_max else None)
        return (band, tenant_policy.priority, 0, 0, arrival_time)

    def _kvq_ranks_above(self, view: _StepView, bound: RankKey) -> bool:
        """Some running request ranks above `bound` in the victim order."""
        if not compat.running_requests(self):
            return False
        _, key = self._kvq_pick_victim(view)
        return key > bound

    def _kvq_reclaim_for_waiting(self) -> None:
        """Preempt running work ranked above the request that found no room last step.

        vLLM admits waiting requests into free blocks only, so without this a premium
        request waits for free-tier work to finish while admission (which counts that
        work as reclaimable) has already let it in. Victims go in victim order, only
        those whose key is above the waiting request's, until the free blocks cover its
        shortfall plus what running requests will allocate first in the step."""
        starved = self._kvq_starved
        self._kvq_starved = None
        assert starved is not None
        request, bound, shortfall = starved
        if shortfall <= 0 or not compat.is_queued(self, request):
            return
        target = compat.free_block_count(self) + shortfall
        view = self._kvq_get_view()
        while compat.free_block_count(self) < target + compat.step_growth_blocks(self):
            victim, key = (
                self._kvq_pick_victim(view) if compat.running_requests(self) else (None, bound)
            )
            if victim is None or key <= bound or not compat.is_running(victim):
                self._kvq_stuck = request
                return
            compat.preempt_between_steps(self, victim)
        self._kvq_stuck = None

    def _kvq_prioritize_prefills(self) -> None:
        """Give the step's token budget to higher tiers' prefills first.

        vLLM schedules running requests in `running` order, prefill chunks included,
        and waiting requests only with what is left, and a step lasts as long as its
        largest prefill: a premium request would wait behind free-tier chunks, and its
        last chunk would share its step with them. So while a higher-priority request
        prefills, or waits to be admitted, lower-priority prefill chunks sit out the
        step (decodes, one token each, always run). Not for a waiting request that could
        not be given room (it would only waste the budget)."""
        prefilling = compat.prefilling(self)
        if not prefilling:
            return
        top = compat.next_waiting(self)
        bound = min(request.priority for request in prefilling)
        if top is not None and top is not self._kvq_stuck:
            bound = min(bound, top.priority)
        for request in prefilling:
            if request.priority > bound:
                compat.skip_next_step(self, request)

    def _kvq_pick_victim(self, view: _StepView) -> tuple[Request, RankKey]:
        """The running request to preempt next (with its key).

        Keys are sorted once per step: nothing they depend on changes while vLLM
        preempts, except a tenant's band when a release ends its borrowing, which
        re-sorts. Under the FCFS policy vLLM always takes the last running request;
        the plugin can only order leases around that choice."""
        running = compat.running_requests(self)
        if not self._kvq_steer_victims:
            return running[-1], self._kvq_running_key(view.ranker, running[-1])
        if view.order is None:
            running_key = view.ranker.running_key
            ids = self._kvq_ids
            keys = view.keys = [
                running_key(tenant, priority, computed, arrival,
                            ids.get(compat.rank_inputs(request)[0], NO_IDENTITY).above_max)
                for request, tenant, priority, computed, arrival in view.entries
            ]
            # Largest key first. The sort is stable (also reversed), so among equal keys
            # the first in `running` goes first, as with vLLM's max().
            view.order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)
            view.next = 0
        while view.next < len(view.order):
            index = view.order[view.next]
            request = view.entries[index][0]
            if compat.is_running(request):
                return request, view.keys[index]
            view.next += 1
        return running[-1], self._kvq_running_key(view.ranker, running[-1])

    def _kvq_best_lease(
        self,
        ranker: VictimRanker,
        bound: RankKey | None,
        own_session: tuple[str, str] | None,
        *,
        idle_only: bool = False,
        tenant: str | None = None,
    ) -> Lease[KVCacheBlock] | None:
        """The lease to release next: the largest key above `bound` (any if None),
        only among `tenant`'s leases if given.

        The requester's own session is never a candidate (its blocks are the prefix
        it is about to reuse); with `idle_only`, sessions with a request in the
        engine are not either (their lease is what makes that request a hit)."""
        best: Lease[KVCacheBlock] | None = None
        best_key: RankKey | None = None
        for lease in self._kvq_leases:
            if lease.key == own_session or (idle_only and lease.key in self._kvq_active):
                continue
            if tenant is not None and lease.tenant != tenant:
                continue
            key = ranker.lease_key(lease)
            if bound is not None and key <= bound:
                continue
            if best_key is None or key > best_key:
                best, best_key = lease, key
        return best

    def _kvq_mark(self, victim: Request) -> None:
        if not self._kvq_steer_victims:
            return
        self._kvq_restore_marks()  # exactly one marked request at a time
        self._kvq_marked[compat.request_id(victim)] = (victim, compat.mark_victim(victim))

    def _kvq_restore_marks(self) -> None:
        for request, priority in self._kvq_marked.values():
            compat.restore_priority(request, priority)
        self._kvq_marked.clear()

    def _kvq_end_step(self) -> None:
        if self._kvq_marked:
            self._kvq_restore_marks()
        self._kvq_view = None
        if self._kvq_degraded.end_step(self._kvq_alloc_failed):
            self._kvq_next_publish = 0.0
        self._kvq_alloc_failed = False

    def _kvq_count_preemption(self, request: Request) -> None:
        req_id = compat.request_id(request)
        identity = self._kvq_ids.get(req_id, NO_IDENTITY)
        tenant = identity.tenant
        policy = self._kvq_watcher.policy
        num_blocks = len(compat.request_block_ids(self, req_id))
        view = self._kvq_view
        if view is not None:
            reason = view.ranker.running_reason(self._kvq_running_key(view.ranker, request))
            view.debit(tenant, num_blocks)
        else:
            reason = Reason.UNCLASSIFIED
        counters = self._kvq_counters[stats_tenant(policy, tenant)]
        counters.preemptions[reason] += 1
        if outgrew(identity, num_blocks, compat.num_prompt_tokens(request),
                   compat.block_size(self)):
            counters.outgrown_preemptions += 1
        if not self._kvq_offloading:
            self._kvq_modes["recompute"] += 1
            return
        self._kvq_preempted[req_id] = num_blocks
        threshold = policy.recompute_below_blocks if policy is not None else 0
        if num_blocks < threshold:
            self._kvq_recompute.add(req_id)

    def _kvq_on_kv_load(self, request: Request, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a waiting request, `num_external_tokens` of them
        to be loaded by the offloading connector."""
        req_id = compat.request_id(request)
        if req_id in self._kvq_preempted:
            self._kvq_forget_preempted(req_id)
            self._kvq_modes["offload" if num_external_tokens else "recompute"] += 1

    def _kvq_forget_preempted(self, req_id: str) -> None:
        self._kvq_preempted.pop(req_id, None)
        self._kvq_recompute.discard(req_id)

    # -- leases ---------------------------------------------------------------------------

    def _kvq_take_lease(self, key: tuple[str, str], req_id: str, seconds: int) -> None:
        policy = self._kvq_watcher.policy
        blocks = compat.cached_blocks(self, req_id)
        cap = lease_block_cap(policy, key[0])
        if cap:
            blocks = blocks[:cap]
        if not blocks:
            return  # nothing cached (e.g. aborted before prefill): keep any older lease
        compat.pin_blocks(self, blocks)
        now = self._kvq_clock()
        pauses = self._kvq_pauses
        hold = pauses.hold_seconds(key)
        lease = Lease(key[0], key[1], blocks, now, now + min(seconds, hold), hold,
                      pauses.return_pause(key))
        # The new references are taken before the replaced lease drops its own, so a
        # prefix shared by both never reaches refcount 0.
        for old, drop in self._kvq_leases.put(lease, policy):
            self._kvq_unpin(old, drop)

    def _kvq_release(self, lease: Lease[KVCacheBlock], reason: Reason, view: _StepView) -> None:
        self._kvq_leases.pop(lease.key)
        self._kvq_unpin(lease, reason)
        view.debit(lease.tenant, lease.num_blocks)

    def _kvq_unpin(self, lease: Lease[KVCacheBlock], why: Reason | LeaseDrop | None) -> None:
        """Drop a lease's references (the caller has taken it out of the table)."""
        now = self._kvq_clock()
        compat.unpin_blocks(self, lease.blocks)
        self._kvq_retention.freed(map(compat.block_id, lease.blocks), now)
        if why is None:
            return  # renewed: its session came back
        counters = self._kvq_counters[stats_tenant(self._kvq_watcher.policy, lease.tenant)]
        # It ended before its session came back: what it held meanwhile bought nothing.
        counters.idle_lease_block_seconds += lease.num_blocks * max(
            0.0, min(now, lease.expires_at) - lease.last_activity
        )
        if why is not LeaseDrop.POLICY and why is not LeaseDrop.RESET:
            self._kvq_pauses.lease_lapsed(lease.tenant)
        if isinstance(why, LeaseDrop):
            counters.lease_drops[why] += 1
            return
        counters.preemptions[why] += 1
        counters.lease_breaks += 1
        if why is Reason.DEGRADED:
            counters.degraded_events += 1
            self._kvq_degraded.note_release(lease.tenant, lease.num_blocks)

    def _kvq_release_expired(self, now: float) -> bool:
        expired = self._kvq_leases.pop_expired(now)
        for lease in expired:
            self._kvq_unpin(lease, LeaseDrop.EXPIRED)
        return bool(expired)

    def _kvq_apply_policy(self) -> None:
        for lease, drop in self._kvq_leases.apply_policy(self._kvq_watcher.policy):
            self._kvq_unpin(lease, drop)
        self._kvq_protect_until = 0.0
        self._kvq_next_publish = 0.0

    def _kvq_evict_first(self, tenant: str | None, now: float) -> bool:
        """Retention order (`tenant_policy.RetentionOrder`): should the blocks a finished
        request of `tenant` leaves go to the front of vLLM's free queue?"""
        policy = self._kvq_watcher.policy
        tenant_policy = policy.tenant(tenant) if policy is not None else None
        if tenant_policy is None or tenant_policy.lease.seconds > 0:
            return False
        assert policy is not None
        if now >= self._kvq_protect_until:
            pauses = self._kvq_pauses
            self._kvq_protect_s = max(
                (min(t.lease.seconds, pauses.typical_pause(t.tenant_id)
                     or t.lease.seconds / pauses.PAUSE_FACTOR)
                 for t in policy.tenants.values() if t.lease.seconds > 0),
                default=0.0,
            )
            self._kvq_protect_until = now + 1.0
        return self._kvq_protect_s > 0 and self._kvq_retention.contended(
            compat.next_evicted_block_id(self), now, self._kvq_protect_s
        )

    # -- accounting and stats ---------------------------------------------------------------

    def _kvq_record_hits(self, output: SchedulerOutput) -> None:
        policy = self._kvq_watcher.policy
        for req_id, num_hit_tokens in compat.new_request_hits(output):
            request = compat.get_request(self, req_id)
            if request is None or not compat.is_first_admission(request):
                continue
            tenant = self._kvq_ids.get(req_id, NO_IDENTITY).tenant
            counters = self._kvq_counters[stats_tenant(policy, tenant)]
            counters.prefix_hit_tokens += num_hit_tokens
            counters.prompt_tokens += compat.num_prompt_tokens(request)

    def _kvq_maybe_idle(self) -> None:
        # Work only when going idle changes something: an open degraded episode or a
        # stats file to refresh. So an instance without plugin state (vLLM's own tests
        # build bare schedulers with object.__new__) behaves exactly like vLLM's.
        degraded = getattr(self, "_kvq_degraded", None)
        if degraded is None or not (degraded.active or self._kvq_publisher is not None):
            return
        if self.has_unfinished_requests():
            return
        self._kvq_degraded.end_step(allocation_failed=False)
        if self._kvq_publisher is not None:
            self._kvq_publish(self._kvq_clock())

    def _kvq_publish(self, now: float) -> None:
        assert self._kvq_publisher is not None
        self._kvq_publisher.publish(self.kvq_snapshot())
        self._kvq_next_publish = now + STEP_INTERVAL_S

    def kvq_snapshot(self) -> StatsSnapshot:
        """Everything the stats file reports, as of now (call from the engine thread)."""
        policy = self._kvq_watcher.policy
        tenants = {tenant: TenantEngineStats() for tenant in (policy.tenants if policy else ())}

        def entry(key: str) -> TenantEngineStats:
            stats = tenants.get(key)
            if stats is None:
                stats = tenants[key] = TenantEngineStats()
            return stats

        entries, held, shared = compat.scan_running(
            self, self._kvq_ids, policy.tenants if policy is not None else {}, self._kvq_marked
        )
        for _, tenant, *_ in entries:
            entry(tenant or UNCLASSIFIED).running += 1
        for tenant, num_blocks in held.items():
            entry(tenant or UNCLASSIFIED).running_blocks += num_blocks
        for tenant, block_ids in shared.items():
            entry(tenant or UNCLASSIFIED).running_blocks += len(block_ids)
        for request in compat.all_requests(self):
            if compat.is_waiting(request):
                tenant = self._kvq_ids.get(compat.request_id(request), NO_IDENTITY).tenant
                entry(stats_tenant(policy, tenant)).waiting += 1

        running_shared: set[int] = set().union(*shared.values())
        counted: dict[str, set[int]] = {}
        pinned: dict[str, set[int]] = {}  # per tenant: ids of lease blocks with refcount > 1
        idle_so_far: dict[str, float] = {}  # block-seconds of live leases of idle sessions
        now = self._kvq_clock()
        views: list[LeaseView] = []
        for lease in self._kvq_leases:
            key = stats_tenant(policy, lease.tenant)
            own = compat.count_lease_only_blocks(
                lease.blocks, running_shared, counted.setdefault(key, set())
            )
            stats = entry(key)
            stats.leased_sessions += 1
            stats.leased_blocks += own
            if lease.key not in self._kvq_active:
                idle_so_far[key] = idle_so_far.get(key, 0.0) + lease.num_blocks * max(
                    0.0, now - lease.last_activity
                )
            stats.leases[lease.session] = lease.num_blocks
            stats.pinned_blocks += compat.count_unshared_blocks(
                lease.blocks, pinned.setdefault(key, set())
            )
            views.append(LeaseView(key, lease.session, lease.last_activity, lease.expires_at,
                                   own))
        for key, block_ids in pinned.items():
            entry(key).pinned_blocks += len(block_ids)
        for req_id, num_blocks in self._kvq_preempted.items():
            if req_id not in self._kvq_recompute:  # waiting to reload from the offload tier
                tenant = self._kvq_ids.get(req_id, NO_IDENTITY).tenant
                entry(stats_tenant(policy, tenant)).swapped_blocks += num_blocks

        for key, counters in self._kvq_counters.tenants.items():
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

        engine = EngineStats(
            timestamp=time.time(),
            policy_version=self._kvq_watcher.version,
            policy_error=self._kvq_watcher.error,
            total_blocks=compat.total_block_count(self),
            free_blocks=compat.free_block_count(self),
            preemption_mode=self._kvq_preemption_mode,
            degraded=self._kvq_degraded.active,
            degraded_episodes=self._kvq_degraded.episodes,
            preemptions_by_mode=dict(self._kvq_modes),
            vllm_version=compat.installed_vllm_version(),
            tenants=tenants,
        )
        return StatsSnapshot(engine, tuple(views))

    def kvq_stats(self) -> EngineStats:
        """The stats as the file would show them now."""
        return self.kvq_snapshot().render(self._kvq_clock(), time.time())


class AsyncTenantAwareScheduler(TenantAwareScheduler, compat.AsyncScheduler):
    """Chosen automatically when vLLM runs with async scheduling."""
