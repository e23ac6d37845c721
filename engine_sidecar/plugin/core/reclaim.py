"""Makes room when vLLM finds no free blocks, in the victim order.

Called for every failed allocation: expired leases go first, then live leases ranked
above the work that would be preempted next (or above a waiting requester), then the
running request vLLM preempts, chosen by the victim order. vLLM never preempts running
work for a waiting request; the plugin does, before the next step, for running work
ranked above it, because admission already counted that work as reclaimable. When
nothing ranks below the requester and nothing else runs, degraded mode releases live
leases so the engine keeps making progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_sidecar.plugin.core.engine_port import Engine, Phase, Request
from engine_sidecar.plugin.core.lease_keeper import LeaseKeeper
from engine_sidecar.plugin.core.offload import OffloadAccounting
from engine_sidecar.plugin.core.tenant_state import TenantState
from engine_sidecar.plugin.core.victim_order import VictimOrder
from engine_sidecar.plugin.rules.identity import outgrew
from engine_sidecar.plugin.rules.ranking import RankKey, Reason


class Reclaim:
    def __init__(self, state: TenantState, engine: Engine, leases: LeaseKeeper,
                 victims: VictimOrder, offload: OffloadAccounting, *, block_size: int) -> None:
        self._state = state
        self._engine = engine
        self._leases = leases
        self._victims = victims
        self._offload = offload
        self._block_size = block_size
        self._allocation_failed = False  # in this step
        # A waiting request that found no room in the last step, the key it ranks with
        # and the free blocks it needed: running work ranked above it is preempted
        # before the next step (`reclaim_for_waiting`).
        self.starved: tuple[Request, RankKey, int] | None = None
        self.stuck: Request | None = None  # reclaim could not make room for it

    def on_allocation_failure(
        self, request: Request, retry: Callable[[], Any], shortfall: Callable[[], int]
    ) -> Any:
        """vLLM could not allocate for `request`: free what the victim order allows and
        `retry()`, or mark the victim vLLM is to preempt and return None."""
        self._allocation_failed = True
        state, engine, leases, victims = self._state, self._engine, self._leases, self._victims
        has_leases = bool(len(state.leases))
        if state.policy is None and not has_leases:
            return None  # nothing to add to vLLM's own choice
        if has_leases and leases.release_expired(state.clock()):
            blocks = retry()
            if blocks is not None:
                return blocks
        requester_running = engine.phase(request) is Phase.RUNNING
        view = victims.get_view()
        identity = state.identity(engine.facts(request).req_id)
        own_session = identity.session_key
        victim: Request | None = None
        waiting_bound: RankKey | None = None
        while True:
            if requester_running:
                victim, bound = victims.pick(view)
            else:
                if waiting_bound is None:
                    need = shortfall() + engine.free_block_count()
                    waiting_bound = victims.waiting_key(view, request, need)
                bound = waiting_bound
            lease = leases.best(view.ranker, bound, own_session, idle_only=True)
            if lease is None:
                break
            leases.release(lease, Reason.LEASE_BREAK, view)
            blocks = retry()
            if blocks is not None:
                return blocks
        if victim is not None and victim is not request:
            victims.mark(victim)
            return None
        if waiting_bound is not None:
            if victims.steer and victims.ranks_above(view, waiting_bound):
                self.starved = (request, waiting_bound, shortfall())
                return None
            # Nothing else ranks above this new request: its own tenant's idle leases
            # make way for it (a tenant's cache never stands in its own way).
            while (lease := leases.best(
                view.ranker, None, own_session, idle_only=True, tenant=identity.tenant
            )) is not None:
                leases.release(lease, Reason.LEASE_BREAK, view)
                blocks = retry()
                if blocks is not None:
                    return blocks
        # Nothing ranks below the requester. If no other request runs either, waiting
        # would stall the engine until leases expire: degraded mode.
        num_others = len(engine.running()) - (1 if requester_running else 0)
        if num_others <= 0:
            while (lease := leases.best(view.ranker, None, own_session)) is not None:
                leases.release(lease, Reason.DEGRADED, view)
                blocks = retry()
                if blocks is not None:
                    return blocks
        if requester_running:
            victims.mark(request)
        return None

    def end_step(self) -> bool:
        """The step is over: did an allocation fail in it?"""
        failed, self._allocation_failed = self._allocation_failed, False
        return failed

    def reclaim_for_waiting(self) -> None:
        """Preempt running work ranked above the request that found no room last step.

        Victims go in victim order, only those whose key is above the waiting
        request's, until the free blocks cover its shortfall plus what running
        requests will allocate first in the step."""
        starved = self.starved
        self.starved = None
        assert starved is not None
        engine, victims = self._engine, self._victims
        request, bound, shortfall = starved
        if shortfall <= 0 or engine.phase(request) is not Phase.QUEUED:
            return
        target = engine.free_block_count() + shortfall
        view = victims.get_view()
        while engine.free_block_count() < target + engine.step_growth_blocks():
            victim, key = victims.pick(view) if engine.running() else (None, bound)
            if victim is None or key <= bound or engine.phase(victim) is not Phase.RUNNING:
                self.stuck = request
                return
            engine.preempt_between_steps(victim)
        self.stuck = None

    def count_preemption(self, request: Request) -> None:
        """vLLM preempts `request` for want of blocks: book why, and how it resumes."""
        state, engine = self._state, self._engine
        facts = engine.facts(request)
        req_id = facts.req_id
        identity = state.identity(req_id)
        num_blocks = engine.num_blocks_held(req_id)
        view = self._victims.view
        if view is not None:
            reason = view.ranker.running_reason(self._victims.running_key(view.ranker, request))
            view.debit(identity.tenant, num_blocks)
        else:
            reason = Reason.UNCLASSIFIED
        counters = state.tally(identity.tenant)
        counters.preemptions[reason] += 1
        if outgrew(identity, num_blocks, facts.num_prompt_tokens, self._block_size):
            counters.outgrown_preemptions += 1
        self._offload.preempted_request(req_id, num_blocks, state.policy)
