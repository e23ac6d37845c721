"""Applies the victim order to the requests running in vLLM.

vLLM's priority policy preempts `max(running, key=(priority, arrival_time))`. To make
it preempt the plugin's choice instead, the chosen victim gets the top priority value
for that instant, restored before the request re-enters the waiting heap, so no
request's priority changes while it is in the heap. Keys are sorted once per step,
lazily, at the first allocation failure.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_sidecar.contract.reclaim import requester_band
from engine_sidecar.plugin.core.engine_port import Engine, Phase, Request, RunningEntry
from engine_sidecar.plugin.core.tenant_state import TenantState
from engine_sidecar.plugin.rules.identity import NO_IDENTITY
from engine_sidecar.plugin.rules.ranking import RankKey, VictimRanker


class StepView:
    """Ranking state for one step; the victim order is sorted lazily."""

    def __init__(self, ranker: VictimRanker, entries: list[RunningEntry]) -> None:
        self.ranker = ranker
        self.entries = entries
        self.keys: list[RankKey] = []  # each entry's running key, set with `order`
        self.order: list[int] | None = None  # entry indices, next victim first
        self.next = 0

    @property
    def ranked(self) -> bool:
        return self.order is not None

    def rank(self, keys: list[RankKey]) -> None:
        """Order the entries by their running keys (`keys[i]` is entry i's)."""
        self.keys = keys
        # Largest key first. The sort is stable (also reversed), so among equal keys the
        # first in `running` goes first, as with vLLM's max().
        self.order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)
        self.next = 0

    def next_victim(self, is_running: Callable[[Request], bool]
                    ) -> tuple[Request, RankKey] | None:
        """The first entry in victim order that still runs; those before it are gone."""
        assert self.order is not None
        while self.next < len(self.order):
            index = self.order[self.next]
            request = self.entries[index][0]
            if is_running(request):
                return request, self.keys[index]
            self.next += 1
        return None

    def debit(self, tenant: str | None, num_blocks: int) -> None:
        if self.ranker.debit(tenant, num_blocks):
            self.order = None  # a tenant stopped borrowing: its keys changed


class VictimOrder:
    """The step's view of running work, the next victim, and the one marked for vLLM."""

    def __init__(self, state: TenantState, engine: Engine, ranker: type[VictimRanker],
                 *, steer: bool) -> None:
        self._state = state
        self._engine = engine
        self._ranker = ranker
        # Under vLLM's priority policy the plugin picks the victims; under FCFS vLLM
        # always takes the last running request and the plugin orders leases around it.
        self.steer = steer
        self.view: StepView | None = None  # built at a step's first allocation failure
        # req_id -> (request, priority to restore); only requests in `running`.
        self.marked: dict[str, tuple[Request, int]] = {}

    def get_view(self) -> StepView:
        """The step's view of running work, built at the first allocation failure.

        One pass over `running`: each request's tenant and rank inputs, and every
        tenant's usage in distinct blocks (running + pinned). A block with refcount 1
        has a single holder, so only shared blocks (a prefix) go through a set."""
        view = self.view
        if view is not None:
            return view
        state = self._state
        engine = self._engine
        policy = state.policy
        entries, scanned, scanned_shared = engine.scan_running(
            state.ids, policy.tenants if policy is not None else {}, self.marked
        )
        # Unclassified work (key None) has no quota to rank against.
        usage = {tenant: n for tenant, n in scanned.items() if tenant is not None}
        shared = {tenant: ids for tenant, ids in scanned_shared.items() if tenant is not None}
        for lease in state.leases:
            lease_shared = shared.setdefault(lease.tenant, set())
            held = engine.count_unshared_blocks(lease.blocks, lease_shared)
            usage[lease.tenant] = usage.get(lease.tenant, 0) + held
        for tenant, block_ids in shared.items():
            usage[tenant] = usage.get(tenant, 0) + len(block_ids)
        view = self.view = StepView(self._ranker(policy, usage), entries)
        return view

    def running_key(self, ranker: VictimRanker, request: Request) -> RankKey:
        facts = self._engine.facts(request)
        mark = self.marked.get(facts.req_id)
        priority = mark[1] if mark is not None else facts.priority
        identity = self._state.identity(facts.req_id)
        return ranker.running_key(identity.tenant, priority, facts.num_computed_tokens,
                                  facts.arrival_time, identity.above_max)

    def waiting_key(self, view: StepView, request: Request, need: int) -> RankKey:
        """The key a waiting request ranks with: as a running request that has computed
        nothing, in the band its tenant would be in once it holds the `need` blocks
        (its own idle leases left out: they yield to it)."""
        state = self._state
        facts = self._engine.facts(request)
        priority, arrival_time = facts.priority, facts.arrival_time
        identity = state.identity(facts.req_id)
        tenant = identity.tenant
        ranker = view.ranker
        tenant_policy = ranker.tenant_policy(tenant)
        if tenant_policy is None:
            return ranker.running_key(tenant, priority, 0, arrival_time)
        idle = sum(
            lease.num_blocks for lease in state.leases
            if lease.tenant == tenant and lease.key not in state.active
        )
        used = max(0, ranker.usage.get(tenant_policy.tenant_id, 0) - idle)
        # The policy the plugin holds is this engine's split: both bounds are per engine.
        band = requester_band(used, need, tenant_policy.guaranteed_blocks,
                              tenant_policy.ceiling if identity.above_max else None)
        return (band, tenant_policy.priority, 0, 0, arrival_time)

    def ranks_above(self, view: StepView, bound: RankKey) -> bool:
        """Some running request ranks above `bound` in the victim order."""
        if not self._engine.running():
            return False
        _, key = self.pick(view)
        return key > bound

    def pick(self, view: StepView) -> tuple[Request, RankKey]:
        """The running request to preempt next (with its key).

        Nothing the keys depend on changes while vLLM preempts, except a tenant's band
        when a release ends its borrowing, which re-sorts."""
        engine = self._engine
        running = engine.running()
        if not self.steer:
            return running[-1], self.running_key(view.ranker, running[-1])
        if not view.ranked:
            running_key = view.ranker.running_key
            ids = self._state.ids
            view.rank([
                running_key(tenant, priority, computed, arrival,
                            ids.get(req_id, NO_IDENTITY).above_max)
                for _, req_id, tenant, priority, computed, arrival in view.entries
            ])
        found = view.next_victim(lambda request: engine.phase(request) is Phase.RUNNING)
        if found is not None:
            return found
        return running[-1], self.running_key(view.ranker, running[-1])

    def mark(self, victim: Request) -> None:
        """Make `victim` the request vLLM's priority policy preempts next."""
        if not self.steer:
            return
        self.restore_marks()  # exactly one marked request at a time
        engine = self._engine
        self.marked[engine.facts(victim).req_id] = (victim, engine.mark_victim(victim))

    def unmark(self, request: Request) -> None:
        """vLLM preempts `request`: it leaves `running` with its own priority."""
        mark = self.marked.pop(self._engine.facts(request).req_id, None)
        if mark is not None:
            self._engine.restore_priority(request, mark[1])

    def restore_marks(self) -> None:
        for request, priority in self.marked.values():
            self._engine.restore_priority(request, priority)
        self.marked.clear()

    def end_step(self) -> None:
        if self.marked:
            self.restore_marks()
        self.view = None
