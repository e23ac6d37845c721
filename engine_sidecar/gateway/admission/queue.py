"""Bounded admission queues: a request that cannot be admitted now waits, it is not
refused at once.

One `AdmissionQueue` per sidecar (and per twin engine: the benchmark runs this code on
virtual time). `submit()` queues a `Ticket` behind its tenant's earlier requests and
`pump()` admits whatever `rules.decide` lets in: tenants in `backlog`'s order (tiers by
priority, VTC within a tier), each tenant's requests first come first served, best
effort; a head that does not fit does not hold back the others. A ticket leaves when
admitted (it holds a reservation), cancelled (nothing held), or refused: at once by
`decide` (400), or with the error it waits on once its wait would pass its tier's
`maxQueueSeconds`, Retry-After from when the requests holding what it needs end (else
the drain rate), jittered. Single event loop, no awaits: a decision and its
reservation are atomic. The order and why: docs/gateway.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.contract.reclaim import watermark_floor
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.backlog import Backlog, TenantQueue
from engine_sidecar.gateway.admission.decode_pace import DecodePace
from engine_sidecar.gateway.admission.idle_kv import IdleKvWaits
from engine_sidecar.gateway.admission.joint_charge import RequestGrowth
from engine_sidecar.gateway.admission.ledger import Ledger, Reservation
from engine_sidecar.gateway.admission.output_estimate import Outlook, OutputEstimates
from engine_sidecar.gateway.admission.rules import (
    Decision,
    PoolView,
    RequestShape,
    Verdict,
    blocks_for,
    decide,
    effective_max_tokens,
    reserved_output,
)
from engine_sidecar.gateway.admission.view_cache import ViewCache
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.pool.admission import PoolAdmission

MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 120
RETRY_AFTER_MS = "retry-after-ms"  # what OpenAI's SDKs read first, in milliseconds
JITTER = 0.5  # Retry-After is drawn from [1 - JITTER, 1 + JITTER] times the estimate


@dataclass(eq=False)
class Ticket:
    """One request asking for admission, from `submit()` until it is settled."""

    tenant_id: str
    shape: RequestShape
    arrived: float
    deadline: float
    payload: Any = None  # the caller's own context (the twin's request, say)
    size: float = 0.0  # blocks it asks for, before sharing (orders the best-effort scan)
    verdict: Verdict | None = None  # the last decision: admitted, or what it waits on
    waited_on: Decision | None = None  # why it last had to wait (None: never waited)
    reservation: Reservation | None = None
    error: ApiError | None = None  # set when refused
    settled_at: float | None = None
    on_settled: Callable[[Ticket], None] | None = None

    @property
    def settled(self) -> bool:
        return self.settled_at is not None

    @property
    def admitted(self) -> bool:
        return self.reservation is not None

    @property
    def waited(self) -> float:
        """Seconds between arrival and admission or refusal (0 while queued)."""
        return 0.0 if self.settled_at is None else self.settled_at - self.arrived




class AdmissionQueue(Backlog):
    def __init__(
        self,
        ledger: Ledger,
        *,
        clock: Callable[[], float],
        stats: Callable[[], EngineStats | None] = lambda: None,
        max_model_len: Callable[[], int | None] = lambda: None,
        rng: random.Random | None = None,
        estimates: OutputEstimates | None = None,
        pace: DecodePace | None = None,
    ) -> None:
        self.ledger = ledger
        # The engine's pace on the relayed streams: when a holder that reports no
        # progress ends (Retry-After).
        self.pace = pace if pace is not None else DecodePace()
        # What `Estimated` reservations count: learned from finished requests (the
        # sidecar's relayed responses, the twin's finished requests).
        self.estimates = estimates if estimates is not None else OutputEstimates()
        self.max_model_len = max_model_len
        self.rng = rng or random.Random()
        super().__init__(clock)
        self._views = ViewCache(ledger, stats)
        self._idle_kv = IdleKvWaits()
        # Seconds each tenant's queued requests waited on its maxBlocks beside idle KV.
        self.idle_waits = self._idle_kv.seconds
        # The pool-wide ledger on a shared store, when the pool names one.
        self.pool: PoolAdmission | None = None

    # -- the caller's side ----------------------------------------------------------

    def set_policy(self, policy: EnginePolicy) -> None:
        """A new policy applies to queued tickets too; tenants it dropped are refused
        (and their learned estimates forgotten)."""
        self.policy = policy
        self.estimates.retain(policy.tenants)
        self._views.forget()

    def submit(self, tenant_id: str, shape: RequestShape, payload: Any = None) -> Ticket:
        """Queue a request of a tenant the policy knows; it may settle right away."""
        assert self.policy is not None
        now = self.clock()
        tenant = self.policy.tenants[tenant_id]
        ticket = Ticket(tenant_id, shape, now, now + tenant.max_queue_seconds, payload)
        max_tokens = effective_max_tokens(tenant, shape, self.max_model_len())
        output = self.estimates.output_tokens(tenant, shape.route, self.policy)
        ticket.size = blocks_for(shape, reserved_output(max_tokens, output),
                                 self.policy.block_size)
        queue = self._queues.get(tenant_id)
        if queue is None:
            queue = self._queues[tenant_id] = TenantQueue()
        if not queue.tickets:
            self._lift(tenant_id, queue)
        else:  # behind its tenant's earlier requests: a refusal for good comes now
            verdict = self._decide_alone(ticket, tenant)
            if verdict.error is not None and not verdict.waits:
                ticket.verdict, ticket.error = verdict, verdict.error
                self._settle(ticket, now)
                return ticket
        queue.tickets.append(ticket)
        self.pump()
        if not ticket.settled:  # still last in its tenant's queue
            position = len(queue.tickets) - 1
            rate = queue.drain_rate(now)
            full = position >= tenant.max_queued_requests
            too_slow = rate is not None and (position + 1) / rate > tenant.max_queue_seconds
            # Alone in its queue, with a pool store: one last decision that asks the store.
            if (full or too_slow) and not (position == 0 and self.pool is not None and (
                    self._try(tenant_id, queue, ticket, 0, now, final=True)
                    or self.pool.asking(tenant_id))):
                queue.tickets.remove(ticket)
                self._refuse(ticket, now)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away while queued: drop the ticket (it holds nothing)."""
        queue = self._queues.get(ticket.tenant_id)
        if not ticket.settled and queue is not None and ticket in queue.tickets:
            queue.tickets.remove(ticket)
            ticket.settled_at = self.clock()

    def pump(self) -> list[Ticket]:
        """Admit what fits now, refuse what waited too long; returns the settled."""
        settled: list[Ticket] = []
        if self.policy is None or not self._queues:
            return settled
        now = self.clock()
        self._expire(now, settled)
        while True:
            # Within ceilings first; then, while nobody waits for capacity, a tenant at
            # its maxBlocks may take the idle blocks (aboveMax: Reclaimable).
            ticket = self._admit_next(now) or (
                None if self._capacity_wanted() else self._admit_next(now, beyond_max=True))
            if ticket is None:
                break
            settled.append(ticket)
        self._note_idle_waits(now)
        return settled

    def released(self, tenant_id: str) -> None:
        """A reservation of `tenant_id` was released (the ledger's `on_release`): the
        pool-wide ledger, when the pool has one, hears what the tenant holds now."""
        if self.pool is not None and self.policy is not None:
            self.pool.released(tenant_id, self.view())

    def view(self) -> PoolView:
        """The pool as admission sees it now (cached until the stats or ledger move)."""
        assert self.policy is not None
        return self._views.view(self.policy)

    @property
    def stats(self) -> Callable[[], EngineStats | None]:  # the plugin's latest reading
        return self._views.stats

    # -- internals ---------------------------------------------------------------------


    def _capacity_wanted(self) -> bool:
        """Some queued request waits for capacity within its tenant's ceiling (the
        watermark): idle blocks are wanted, so nobody may take them beyond maxBlocks."""
        return any(ticket.waited_on is Decision.REJECTED_WATERMARK
                   for queue in self._queues.values() for ticket in queue.tickets)

    def _note_idle_waits(self, now: float) -> None:
        """Charge the time since the last pump to the requests that waited on their
        tenant's maxBlocks while the blocks they asked for sat idle above the watermark
        and nobody waited for capacity ("waited beside idle KV", `idle_kv`)."""
        capped = [] if self.policy is None else [
            (tenant_id, ticket.verdict.new_blocks)
            for tenant_id, queue in self._queues.items() for ticket in queue.tickets
            if ticket.verdict is not None and ticket.waited_on is Decision.REJECTED_QUOTA]
        if capped and self._capacity_wanted():
            capped = []
        self._idle_kv.note(now, capped, self._idle_blocks)

    def _idle_blocks(self) -> int | None:
        """Free blocks above the watermark (None: the engine's size is not known yet)."""
        assert self.policy is not None
        view = self.view()
        if view.total_blocks is None:
            return None
        return view.free_blocks - watermark_floor(self.policy.watermark, view.total_blocks)

    def _admit_next(self, now: float, beyond_max: bool = False) -> Ticket | None:
        """Settle the first request in order that can settle now (admitted, or refused
        for good); None when every one must keep waiting. `beyond_max`: only tickets
        waiting on their tenant's maxBlocks are tried, allowed past it (`decide`)."""
        for tenant_id, queue in self._order():
            smallest_waiting = math.inf  # a request at least this large waits too
            for index, ticket in enumerate(queue.tickets):
                if ticket.size >= smallest_waiting:
                    continue
                if beyond_max and ticket.waited_on is not Decision.REJECTED_QUOTA:
                    break
                if self._try(tenant_id, queue, ticket, index, now, beyond_max):
                    return ticket
                verdict = ticket.verdict
                if verdict is not None and verdict.decision is Decision.REJECTED_CONCURRENCY:
                    break
                smallest_waiting = ticket.size
        return None

    def _try(
        self, tenant_id: str, queue: TenantQueue, ticket: Ticket, index: int, now: float,
        beyond_max: bool = False, final: bool = False,
    ) -> bool:
        """Decide one queued ticket; settle it (True) unless it must keep waiting.
        `final`: refused if it waits (the pool-wide ledger is asked, however recently)."""
        assert self.policy is not None
        verdict = self._decide_now(ticket, now, beyond_max, final)
        ticket.verdict = verdict
        if verdict.waits:
            ticket.waited_on = verdict.decision
            return False
        del queue.tickets[index]
        if verdict.admitted:
            weight = max(1, self.policy.tenants[tenant_id].guaranteed_blocks)
            queue.served += verdict.blocks / weight
            queue.admissions.append(now)
            shape = ticket.shape
            sequences = shape.n * max(1, len(shape.prompt_tokens))
            ticket.reservation = self.ledger.reserve(
                tenant_id, verdict.extra, shape.session, shape.prefix,
                verdict.remainder, self.growth(tenant_id, shape, verdict.max_tokens),
                verdict.above_max, started=now,
                max_output=verdict.max_tokens * sequences, sequences=sequences,
            )
        else:
            ticket.error = verdict.error
        self._settle(ticket, now)
        return True

    def _expire(self, now: float, settled: list[Ticket]) -> None:
        """Refuse heads past their deadline (or of tenants the policy dropped) with what
        they wait on; a head that fits by now is admitted instead."""
        assert self.policy is not None
        for tenant_id, queue in list(self._queues.items()):
            gone = tenant_id not in self.policy.tenants
            if gone and not queue.tickets:
                del self._queues[tenant_id]
                continue
            while queue.tickets and (gone or queue.tickets[0].deadline <= now):
                ticket = queue.tickets[0]
                if not gone and (self._try(tenant_id, queue, ticket, 0, now, final=True) or (
                        not self._capacity_wanted()
                        and self._try(tenant_id, queue, ticket, 0, now, beyond_max=True,
                                      final=True))):
                    settled.append(ticket)
                    continue
                if not gone and self.pool is not None and self.pool.asking(tenant_id):
                    break  # decided when the store answers (it wakes the pump)
                queue.tickets.popleft()
                self._refuse(ticket, now)
                settled.append(ticket)

    def _refuse(self, ticket: Ticket, now: float) -> None:
        """Refuse with what the ticket waited on, Retry-After from when the requests in
        flight free what it needs (else the drain rate)."""
        queue = self._queues.get(ticket.tenant_id)
        verdict = ticket.verdict
        gone = self.policy is None or ticket.tenant_id not in self.policy.tenants
        if verdict is None or verdict.error is None or gone:
            verdict = ticket.verdict = self._decide_now(ticket, now)
        if verdict.error is None and queue is not None and queue.tickets:
            # It would fit, but waits behind its tenant's earlier requests (first come,
            # first served): it is refused for what the first of them waits on.
            head = queue.tickets[0].verdict
            if head is not None and head.error is not None:
                verdict = ticket.verdict = replace(verdict, decision=head.decision,
                                                   error=head.error)
        assert verdict.error is not None, "refusing a request that fits"
        tenant = self.policy.tenants.get(ticket.tenant_id) if self.policy else None
        error = verdict.error
        frees = self._frees_in(ticket.tenant_id, verdict, tenant, now)
        wait = _retry_after(queue, now, tenant, self.rng, frees)
        ticket.error = ApiError(
            error.status, error.code, error.message, param=error.param,
            retry_after=min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(wait))),
            headers={**error.headers, RETRY_AFTER_MS: str(math.ceil(wait * 1000))})
        self._settle(ticket, now)

    def _frees_in(self, tenant_id: str, verdict: Verdict, tenant: TenantPolicy | None,
                  now: float) -> float | None:
        """Seconds until requests in flight give back what a refused request needs: on
        its tenant's limits, the tenant's own (a concurrency slot: the first to end;
        blocks: enough of them); on the engine's watermark, any tenant's here, soonest
        first, until the blocks above the watermark cover what it would borrow. Each
        ends once it has decoded all it may, at its rate so far or, before it reports a
        token (a response not streamed), at the engine's pace (`Reservation.ends_in`).
        None when that is not known (a holder of its tenant's of unknown end; on the
        watermark, too few of known end to free enough)."""
        if tenant is None or self.policy is None:
            return None
        decision = verdict.decision
        if decision in (Decision.REJECTED_QUOTA, Decision.REJECTED_CONCURRENCY):
            live = self.ledger.live(tenant_id)
            ends = [r.ends_in(now, self.pace) for r in live]
            if not live or any(end is None for end in ends):
                return None
            order = sorted(zip((e or 0.0 for e in ends), live, strict=True),
                           key=lambda x: x[0])
            if decision is Decision.REJECTED_CONCURRENCY:
                return order[0][0]
            need = (self.view().tenant(tenant_id).charged + verdict.blocks
                    - tenant.max_blocks_per_engine)
        elif decision is Decision.REJECTED_WATERMARK:
            view = self.view()
            if view.total_blocks is None:
                return None
            # Free blocks in the view leave out growth still to come, which a holder's
            # end frees with the rest of its turn_blocks: short of the floor counts too.
            need = verdict.new_blocks - (view.free_blocks - watermark_floor(
                self.policy.watermark, view.total_blocks))
            order = sorted(((end, r) for holder in self.ledger.tenants()
                            for r in self.ledger.live(holder)
                            if (end := r.ends_in(now, self.pace)) is not None),
                           key=lambda x: x[0])
            if not order:
                return None
        else:
            return None
        freed = 0
        for end, reservation in order:
            freed += reservation.turn_blocks
            if freed >= need:
                return end
        # The tenant's own give back all they may and still not enough: its last to end.
        return order[-1][0] if decision is Decision.REJECTED_QUOTA else None

    def _decide_alone(self, ticket: Ticket, tenant: TenantPolicy) -> Verdict:
        """The decision on this engine alone (no pool-wide ledger): what the request
        asks for may be refused for good (400) whatever the queue and the store say."""
        assert self.policy is not None
        policy = self.policy
        return decide(tenant, ticket.shape, block_size=policy.block_size,
                      watermark=policy.watermark, view=self.view(),
                      max_model_len=self.max_model_len(),
                      outlook=self.estimates.outlook(tenant, ticket.shape.route, policy))

    def _decide_now(self, ticket: Ticket, now: float, beyond_max: bool = False,
                    final: bool = False) -> Verdict:
        assert self.policy is not None
        tenant = self.policy.tenants.get(ticket.tenant_id)
        if tenant is None:
            error = ApiError(403, errors.UNKNOWN_TENANT,
                             f"tenant {ticket.tenant_id!r} is no longer in the pool's policy")
            return Verdict(Decision.REJECTED_AUTH, 0, 0, error)
        policy, view = self.policy, self.view()

        def run(tenant: TenantPolicy, *, pool_guarantee: bool = False) -> Verdict:
            return decide(tenant, ticket.shape, block_size=policy.block_size,
                          watermark=policy.watermark, view=view,
                          max_model_len=self.max_model_len(),
                          outlook=self.estimates.outlook(tenant, ticket.shape.route, policy),
                          beyond_max=beyond_max, pool_guarantee=pool_guarantee)

        if self.pool is None:
            return run(tenant)
        return self.pool.decide(tenant, view, run, now, final=final)

    def growth(self, tenant_id: str, shape: RequestShape, max_tokens: int) -> RequestGrowth:
        """How an admitted request's take and remainder follow what it decodes (its
        tenant's learned lengths beyond that point, as they stand at each update)."""
        assert self.policy is not None
        policy, estimates = self.policy, self.estimates
        tenant = policy.tenants[tenant_id]

        def outlook(decoded: int) -> Outlook:
            ahead = estimates.outlook(tenant, shape.route, policy, decoded)
            room = max_tokens - decoded
            return Outlook.exactly(room) if ahead is None else ahead.capped(room)

        full = len(shape.prefix)
        return RequestGrowth(shape.prompt_tokens, shape.n, full, policy.block_size, outlook)

    def _settle(self, ticket: Ticket, now: float) -> None:
        ticket.settled_at = now
        if ticket.on_settled is not None:
            ticket.on_settled(ticket)


def _retry_after(queue: TenantQueue | None, now: float, tenant: TenantPolicy | None,
                 rng: random.Random, frees: float | None = None) -> float:
    """Seconds until a refused request is likely to get through, jittered so refused
    clients do not come back in lockstep. `frees`: when its tenant's requests give back
    what it needs (`_frees_in`); then never earlier than that, and later by up to
    JITTER of it when those ahead of it in the queue would take longer. Else those
    ahead of it over its tenant's drain rate (else its maxQueueSeconds)."""
    rate = queue.drain_rate(now) if queue else None
    ahead = len(queue.tickets) + 1 if queue else 1
    drained = ahead / rate if rate else None
    if frees is not None:
        return max(frees, drained or 0.0) * rng.uniform(1, 1 + JITTER)
    estimate = drained if drained is not None else (tenant.max_queue_seconds if tenant
                                                    else 1.0)
    return max(MIN_RETRY_AFTER_S, estimate * rng.uniform(1 - JITTER, 1 + JITTER))
