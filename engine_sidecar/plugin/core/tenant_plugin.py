"""The plugin's parts, composed, and what each of vLLM's hooks asks of them.

`scheduler.TenantAwareScheduler` translates vLLM's calls and hands them here; nothing
here imports vLLM. The parts share one `TenantState` and reach the engine through
`engine_port.Engine`: sessions and leases (`lease_keeper`), the victim order
(`victim_order`, `reclaim`), prefill order, retention, offload accounting and stats.
The policy file is polled between steps and the stats file refreshed while it steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.core.engine_port import Block, Engine, EngineFacts, Phase, Request
from engine_sidecar.plugin.core.lease_keeper import LeaseKeeper
from engine_sidecar.plugin.core.offload import OffloadAccounting
from engine_sidecar.plugin.core.prefill_order import prioritize_prefills
from engine_sidecar.plugin.core.reclaim import Reclaim
from engine_sidecar.plugin.core.retention import Retention
from engine_sidecar.plugin.core.stats_view import StatsView
from engine_sidecar.plugin.core.tenant_state import TenantState
from engine_sidecar.plugin.core.victim_order import VictimOrder
from engine_sidecar.plugin.policy_watch import PolicyWatcher
from engine_sidecar.plugin.rules.identity import NO_IDENTITY, Identity, identity_from_extra_args
from engine_sidecar.plugin.rules.leases import LeaseTable, lease_seconds
from engine_sidecar.plugin.stats_publisher import STEP_INTERVAL_S, StatsPublisher, StatsSnapshot

# What a finished request leaves: its identity and its blocks, in prefix order.
Freed = tuple[Identity, list[Block]]


class TenantPlugin:
    def __init__(self, engine: Engine, config: PluginConfig, facts: EngineFacts) -> None:
        self.engine = engine
        self.clock = config.clock
        self.state = state = TenantState(
            clock=self.clock,
            watcher=PolicyWatcher(config.policy_path, clock=self.now, engine=config.engine),
            leases=LeaseTable(engine.block_id),
        )
        self.retention = Retention(state, engine)
        self.leases = LeaseKeeper(state, engine, self.retention)
        self.victims = VictimOrder(state, engine, config.ranker, steer=facts.steer_victims)
        self.offload = OffloadAccounting(engine, offloading=facts.offloading)
        self.reclaim = Reclaim(state, engine, self.leases, self.victims, self.offload,
                               block_size=facts.block_size)
        self.stats = StatsView(state, engine, self.victims, self.offload, facts)
        self.in_step = False
        self._step_started = 0.0
        self._next_publish = 0.0
        state.watcher.poll(force=True)
        self._apply_policy()
        self.publisher: StatsPublisher | None = None
        if config.stats_path:
            self.publisher = StatsPublisher(
                config.stats_path, policy_path=state.watcher.path, clock=self.now
            )
            self._publish(self.clock())  # readers see the engine before a step

    def now(self) -> float:
        return self.clock()

    # -- requests ---------------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        engine, state = self.engine, self.state
        facts = engine.facts(request)
        req_id = facts.req_id
        if engine.get_request(req_id) is not None:
            return
        identity = identity_from_extra_args(facts.extra_args)
        if identity is NO_IDENTITY:
            return
        state.ids[req_id] = identity
        key = identity.session_key
        if key is not None:
            now = self.clock()
            state.active[key] += 1
            state.pauses.turn_started(key, now)
            state.leases.touch(key, now, lease_seconds(state.policy, identity.tenant))

    def request_finishing(self, request: Request) -> Freed:
        """Before vLLM drops a finished request's references: lease its prefix, so the
        blocks never reach refcount 0 and nothing can evict them in between."""
        engine, state = self.engine, self.state
        req_id = engine.facts(request).req_id
        if self.offload.preempted:
            self.offload.forget(req_id)  # finished (e.g. aborted) before resuming
        identity = state.ids.pop(req_id, NO_IDENTITY)
        key = identity.session_key
        if key is not None:
            state.active[key] -= 1
            if state.active[key] <= 0:
                del state.active[key]
                state.pauses.turn_ended(key, self.clock())
            seconds = lease_seconds(state.policy, identity.tenant)
            if seconds > 0 and engine.phase(request) is not Phase.DISCARDED:
                self.leases.take(key, req_id, seconds)
        return identity, engine.request_blocks(req_id)

    def request_freed(self, freed: Freed) -> None:
        identity, blocks = freed
        self.retention.request_freed(identity.tenant, blocks, self.clock())

    def preempting(self, request: Request) -> None:
        self.victims.unmark(request)
        if self.in_step:  # vLLM ran out of blocks (not a prefix-cache reset)
            self.reclaim.count_preemption(request)

    # -- steps ------------------------------------------------------------------------

    def step_starting(self) -> None:
        state = self.state
        self._step_started = now = self.clock()
        if state.watcher.poll():
            self._apply_policy()
        if len(state.leases):
            self.leases.release_expired(now)
        self.in_step = True
        if self.reclaim.starved is not None:
            self.reclaim.reclaim_for_waiting()
        if self.victims.steer and state.policy is not None:
            prioritize_prefills(self.engine, self.reclaim.stuck)

    def step_ended(self) -> None:
        """After vLLM's schedule(), also when it raised."""
        self.in_step = False
        self.victims.end_step()
        if self.state.degraded.end_step(self.reclaim.end_step()):
            self._next_publish = 0.0

    def step_scheduled(self, new_request_hits: Iterable[tuple[str, int]]) -> None:
        """The step's output: (req_id, prefix-hit tokens) of the requests it admitted."""
        engine, state = self.engine, self.state
        for req_id, num_hit_tokens in new_request_hits:
            request = engine.get_request(req_id)
            if request is None:
                continue
            facts = engine.facts(request)
            if facts.num_preemptions:  # resumed: counted at its first admission
                continue
            counters = state.tally(state.identity(req_id).tenant)
            counters.prefix_hit_tokens += num_hit_tokens
            counters.prompt_tokens += facts.num_prompt_tokens
        if self.publisher is not None and self._step_started >= self._next_publish:
            self._publish(self._step_started)

    def maybe_idle(self) -> None:
        # Work only when going idle changes something: an open degraded episode or a
        # stats file to refresh.
        degraded = self.state.degraded
        if not (degraded.active or self.publisher is not None):
            return
        if self.engine.has_unfinished_requests():
            return
        degraded.end_step(allocation_failed=False)
        if self.publisher is not None:
            self._publish(self.clock())

    def prefix_cache_resetting(self) -> None:
        # vLLM resets only when every block is free: pinned blocks must go first.
        self.leases.drop_all()

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close(self.snapshot())
            self.publisher = None

    # -- policy and stats -------------------------------------------------------------

    def _apply_policy(self) -> None:
        self.leases.apply_policy()
        self.retention.policy_changed()
        self._next_publish = 0.0

    def _publish(self, now: float) -> None:
        assert self.publisher is not None
        self.publisher.publish(self.snapshot())
        self._next_publish = now + STEP_INTERVAL_S

    def snapshot(self) -> StatsSnapshot:
        return self.stats.snapshot()

    def render_stats(self) -> EngineStats:
        return self.snapshot().render(self.clock(), time.time())
