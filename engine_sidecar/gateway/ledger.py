"""Outstanding KV-block reservations and in-flight requests, per tenant.

Single event loop, no awaits inside: a check in `admission.decide` followed by
`reserve()` is atomic. Each Reservation releases exactly once, whichever of
completion, upstream error, timeout or client disconnect comes first, so the totals
return to zero after any mix of outcomes.
"""

from __future__ import annotations

from collections import defaultdict
from types import TracebackType


class Reservation:
    __slots__ = ("_ledger", "blocks", "outcome", "released", "tenant_id")

    def __init__(self, ledger: Ledger, tenant_id: str, blocks: int) -> None:
        self._ledger = ledger
        self.tenant_id = tenant_id
        self.blocks = blocks
        self.released = False
        self.outcome: str | None = None

    def release(self, outcome: str = "completed") -> bool:
        """Give the blocks back; True the first time, False on every later call."""
        if self.released:
            return False
        self.released = True
        self.outcome = outcome
        self._ledger._give_back(self)
        return True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release("completed" if exc_type is None else "cancelled")


class Ledger:
    def __init__(self) -> None:
        self._blocks: dict[str, int] = defaultdict(int)
        self._inflight: dict[str, int] = defaultdict(int)
        self.total_blocks = 0
        self.total_inflight = 0

    def reserve(self, tenant_id: str, blocks: int) -> Reservation:
        self._blocks[tenant_id] += blocks
        self._inflight[tenant_id] += 1
        self.total_blocks += blocks
        self.total_inflight += 1
        return Reservation(self, tenant_id, blocks)

    def _give_back(self, reservation: Reservation) -> None:
        tenant = reservation.tenant_id
        self._blocks[tenant] -= reservation.blocks
        self._inflight[tenant] -= 1
        self.total_blocks -= reservation.blocks
        self.total_inflight -= 1
        if self._inflight[tenant] == 0:
            del self._inflight[tenant]
            del self._blocks[tenant]

    def reserved_blocks(self, tenant_id: str) -> int:
        return self._blocks.get(tenant_id, 0)

    def inflight(self, tenant_id: str) -> int:
        return self._inflight.get(tenant_id, 0)

    def tenants(self) -> list[str]:
        return list(self._inflight)

