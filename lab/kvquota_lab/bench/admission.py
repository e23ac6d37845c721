"""The sidecar's admission queue on virtual time: the same code, other inputs.

`engine_sidecar.gateway.admission.queue.AdmissionQueue` (with `admission.decide` and
the `ledger` under it) is the whole admission path of the sidecar and has no I/O, so
the twin runs it as is. Only the inputs differ: the clock is the twin's, and the
plugin's stats are read as often as the plugin publishes them (every
`STEP_INTERVAL_S`), as the sidecar reads its stats file.

Output estimates are learned as the sidecar learns them: when a turn completes, its
output length goes into the queue's `OutputEstimates.observe` (the sidecar's relayed
response does the same, `output_meter`), on the route `TWIN_ROUTE` (the twin's turns
are chat conversations). The twin sets the turn's output tokens on its payload's
outcome before it releases the reservation, so the release is where it is read.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine_sidecar.contract.names import ABOVE_MAX_ARG, RESERVED_BLOCKS_ARG
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.ledger import Ledger, Reservation
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import RequestShape, sequence_blocks
from engine_sidecar.gateway.counting.prefix import block_fingerprints
from engine_sidecar.gateway.intake.openai_request import Kind
from kvquota_lab.bench.charges import ChargeReading

TWIN_ROUTE = Kind.CHAT.value


def finished_output(payload: Any) -> int | None:
    """The output tokens of a twin turn once it finished (its outcome's count)."""
    outcome = getattr(payload, "outcome", None)
    tokens = getattr(outcome, "output_tokens", None)
    return tokens if isinstance(tokens, int) else None


class TwinGateway:
    def __init__(
        self,
        policy: EnginePolicy,
        *,
        clock: Callable[[], float],
        stats: Callable[[], EngineStats | None],
        stats_interval: float,
        max_model_len: int | None,
        seed: int,
    ) -> None:
        self.ledger = Ledger(on_release=self._changed)
        self.queue = AdmissionQueue(
            self.ledger, clock=clock, stats=stats, max_model_len=lambda: max_model_len,
            rng=random.Random(seed),
        )
        self.queue.set_policy(policy)
        self.clock = clock
        self.stats_interval = stats_interval
        self._dirty = False
        self._next_check = 0.0
        self._settled: list[Ticket] = []
        self._admitted: dict[Reservation, Ticket] = {}  # until released
        self.admitted_blocks: dict[str, int] = {}  # per tenant, what admission added

    def set_policy(self, policy: EnginePolicy) -> None:
        """A new policy (the operator re-split the quotas): the queue is pumped at the
        next poll, as a raised quota may admit what waits."""
        self.queue.set_policy(policy)
        self._dirty = True

    def _changed(self, reservation: Reservation) -> None:
        self._dirty = True
        self.queue.released(reservation.tenant_id)
        ticket = self._admitted.pop(reservation, None)
        if ticket is None or reservation.outcome != "completed":
            return
        tokens = finished_output(ticket.payload)
        if tokens is not None:
            self.queue.estimates.observe(ticket.tenant_id, ticket.shape.route, tokens,
                                         ticket.shape.n)

    def _track(self, ticket: Ticket) -> None:
        if ticket.reservation is not None and ticket.reservation not in self._admitted:
            self._admitted[ticket.reservation] = ticket
            assert ticket.verdict is not None
            self.admitted_blocks[ticket.tenant_id] = (
                self.admitted_blocks.get(ticket.tenant_id, 0) + ticket.verdict.blocks)

    def charge_readings(self, tenants: Iterable[str]) -> dict[str, ChargeReading]:
        """What admission charges each tenant now beside what its requests hold
        (`bench.charges`)."""
        view = self.queue.view()
        readings = {}
        for tenant_id in tenants:
            seen = view.tenant(tenant_id)
            readings[tenant_id] = ChargeReading(
                seen.charged, seen.running, seen.reserved,
                self.admitted_blocks.get(tenant_id, 0), seen.inflight)
        return readings

    def _on_settled(self, ticket: Ticket) -> None:
        self._track(ticket)
        self._settled.append(ticket)

    def submit(
        self, tenant_id: str, prompt: Sequence[int], requested_max_tokens: int | None,
        session: str | None, payload: Any,
    ) -> Ticket:
        """Queue a turn; it may be settled at once (then it is not in `poll()`)."""
        assert self.queue.policy is not None
        shape = RequestShape(
            (len(prompt),), requested_max_tokens, session=session,
            prefix=block_fingerprints(prompt, self.queue.policy.block_size),
            route=TWIN_ROUTE,
        )
        ticket = self.queue.submit(tenant_id, shape, payload)
        if not ticket.settled:
            ticket.on_settled = self._on_settled
        self._track(ticket)
        return ticket

    def plugin_args(self, ticket: Ticket) -> dict[str, int | bool]:
        """The `vllm_xargs` the sidecar adds for an admitted turn beyond tenant and
        session: the blocks reserved per sequence, so the plugin counts a victim that
        outgrew its estimate (`outgrownPreemptions`) as it does behind a real sidecar,
        and whether it runs beyond its tenant's maxBlocks."""
        assert self.queue.policy is not None and ticket.verdict is not None
        args: dict[str, int | bool] = {RESERVED_BLOCKS_ARG: sequence_blocks(
            ticket.shape, ticket.verdict.output_tokens, self.queue.policy.block_size)}
        if ticket.verdict.above_max:
            args[ABOVE_MAX_ARG] = True
        return args

    def poll(self) -> list[Ticket]:
        """The queued turns settled since the last call. The queue is pumped as the
        sidecar's pump loop would: after a release at once, otherwise when new stats
        are out or a deadline has passed (a submit pumps too)."""
        if self.queue.waiting():
            now = self.clock()
            deadline = self.queue.next_deadline()
            due = deadline is not None and deadline <= now
            if self._dirty or due or now >= self._next_check:
                self._dirty = False
                self._next_check = now + self.stats_interval
                self.queue.pump()
        settled, self._settled = self._settled, []
        return settled

    def next_wakeup(self) -> float | None:
        """When `poll` may next settle something while the engine has nothing to do."""
        if not self.queue.waiting():
            return None
        deadline = self.queue.next_deadline()
        check = max(self._next_check, self.clock())
        return check if deadline is None else min(check, deadline)
