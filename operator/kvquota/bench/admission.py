"""The sidecar's admission queue on virtual time: the same code, other inputs.

`engine_sidecar.gateway.admission_queue.AdmissionQueue` (with `admission.decide` and
the `ledger` under it) is the whole admission path of the sidecar and has no I/O, so
the twin runs it as is. Only the inputs differ: the clock is the twin's, and the
plugin's stats are read as often as the plugin publishes them (every
`STEP_INTERVAL_S`), as the sidecar reads its stats file.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from engine_sidecar.gateway.admission import RequestShape
from engine_sidecar.gateway.admission_queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.ledger import Ledger
from engine_sidecar.gateway.prefix import block_fingerprints
from engine_sidecar.policy import EnginePolicy
from engine_sidecar.stats import EngineStats


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

    def set_policy(self, policy: EnginePolicy) -> None:
        """A new policy (the operator re-split the quotas): the queue is pumped at the
        next poll, as a raised quota may admit what waits."""
        self.queue.set_policy(policy)
        self._dirty = True

    def _changed(self, _reservation: object) -> None:
        self._dirty = True

    def _on_settled(self, ticket: Ticket) -> None:
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
        )
        ticket = self.queue.submit(tenant_id, shape, payload)
        if not ticket.settled:
            ticket.on_settled = self._on_settled
        return ticket

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
