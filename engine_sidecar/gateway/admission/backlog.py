"""The requests waiting for admission: one first-come-first-served queue per tenant, and
the order the tenants are tried in. Tiers strictly by priority; within a tier, virtual
token counting (VTC): each tenant's counter grows by the blocks it is admitted over its
guaranteed blocks, the lowest backlogged counter goes first, and a tenant that joins the
backlog is lifted to the lowest counter waiting, so idleness banks no credit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_sidecar.contract.policy import EnginePolicy

if TYPE_CHECKING:
    from engine_sidecar.gateway.admission.queue import Ticket

RATE_SAMPLES = 32  # admissions per tenant the drain rate is measured over
RATE_WINDOW_S = 60.0  # older admissions say nothing about the current drain rate


@dataclass
class TenantQueue:
    """One tenant's queued tickets, first come first served, and its fair-share counter."""

    tickets: deque[Ticket] = field(default_factory=deque)
    served: float = 0.0  # VTC counter: blocks admitted / weight
    admissions: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def drain_rate(self, now: float) -> float | None:
        """Admissions per second lately, or None when too few to say."""
        times = [t for t in self.admissions if now - t <= RATE_WINDOW_S]
        if len(times) < 4 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])


class Backlog:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.policy: EnginePolicy | None = None
        self._queues: dict[str, TenantQueue] = {}

    def next_deadline(self) -> float | None:
        """When the first queued ticket times out (heads: a tenant's queue is FIFO)."""
        return min((q.tickets[0].deadline for q in self._queues.values() if q.tickets),
                   default=None)

    def depth(self, tenant_id: str) -> int:
        queue = self._queues.get(tenant_id)
        return len(queue.tickets) if queue else 0

    def oldest_wait(self, tenant_id: str) -> float:
        queue = self._queues.get(tenant_id)
        if not queue or not queue.tickets:
            return 0.0
        return max(0.0, self.clock() - queue.tickets[0].arrived)

    def waiting(self) -> int:
        return sum(len(q.tickets) for q in self._queues.values())

    def tenants(self) -> list[str]:
        return [t for t, q in self._queues.items() if q.tickets]

    def _lift(self, tenant_id: str, queue: TenantQueue) -> None:
        """VTC: a tenant joining the backlog starts level with the least served one of
        its tier, so time spent idle is not credit."""
        assert self.policy is not None
        tier = self.policy.tenants[tenant_id].priority
        counters = [
            q.served for t, q in self._queues.items()
            if q.tickets and t in self.policy.tenants and self.policy.tenants[t].priority == tier
        ]
        if counters:
            queue.served = max(queue.served, min(counters))

    def _order(self) -> list[tuple[str, TenantQueue]]:
        assert self.policy is not None
        tenants = self.policy.tenants
        backlog = [(t, q) for t, q in self._queues.items() if q.tickets and t in tenants]
        backlog.sort(key=lambda item: (tenants[item[0]].priority, item[1].served))
        return backlog
