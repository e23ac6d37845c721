"""Outstanding KV-block reservations and in-flight requests, per tenant.

A reservation holds the fingerprints of its prompt's full blocks (`prefix`) and a
number of further blocks (`extra`: the partial last block, the completion, further
sequences). A tenant's reserved blocks are its *distinct* prefix blocks plus its
extras, the way vLLM's prefix cache holds them: two requests that share a system prompt
reserve it once.

Single event loop, no awaits inside: a check in `admission.decide` followed by
`reserve()` is atomic. Each Reservation releases exactly once, whichever of
completion, upstream error, timeout or client disconnect comes first, so the totals
return to zero after any mix of outcomes. `version` changes with every reservation and
release, so views derived from the ledger can be cached until it moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container
from types import TracebackType


class Reservation:
    __slots__ = ("_ledger", "extra", "outcome", "prefix", "released", "session", "tenant_id")

    def __init__(
        self, ledger: Ledger, tenant_id: str, extra: int, session: str | None,
        prefix: tuple[int, ...],
    ) -> None:
        self._ledger = ledger
        self.tenant_id = tenant_id
        self.extra = extra
        self.prefix = prefix
        self.session = session
        self.released = False
        self.outcome: str | None = None

    @property
    def blocks(self) -> int:
        """The request's own footprint (shared prefix blocks included)."""
        return len(self.prefix) + self.extra

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


class _Tenant:
    __slots__ = ("extra", "inflight", "prefix", "sessions")

    def __init__(self) -> None:
        self.prefix: Counter[int] = Counter()  # fingerprint -> reservations holding it
        self.extra = 0
        self.inflight = 0
        self.sessions: Counter[str] = Counter()

    @property
    def blocks(self) -> int:
        return len(self.prefix) + self.extra


class Ledger:
    def __init__(self, on_release: Callable[[Reservation], None] | None = None) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self.total_blocks = 0
        self.total_inflight = 0
        self.version = 0
        self.on_release = on_release

    def reserve(
        self, tenant_id: str, extra: int, session: str | None = None,
        prefix: tuple[int, ...] = (),
    ) -> Reservation:
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = self._tenants[tenant_id] = _Tenant()
        before = tenant.blocks
        tenant.prefix.update(prefix)
        tenant.extra += extra
        tenant.inflight += 1
        if session is not None:
            tenant.sessions[session] += 1
        self.total_blocks += tenant.blocks - before
        self.total_inflight += 1
        self.version += 1
        return Reservation(self, tenant_id, extra, session, prefix)

    def _give_back(self, reservation: Reservation) -> None:
        tenant = self._tenants[reservation.tenant_id]
        before = tenant.blocks
        held = tenant.prefix  # one pass (Counter.subtract is a Python loop of its own)
        for fingerprint in reservation.prefix:
            left = held[fingerprint] - 1
            if left > 0:
                held[fingerprint] = left
            else:
                held.pop(fingerprint, None)
        tenant.extra -= reservation.extra
        tenant.inflight -= 1
        if reservation.session is not None:
            tenant.sessions[reservation.session] -= 1
            if tenant.sessions[reservation.session] <= 0:
                del tenant.sessions[reservation.session]
        self.total_blocks += tenant.blocks - before
        self.total_inflight -= 1
        self.version += 1
        if tenant.inflight == 0:
            del self._tenants[reservation.tenant_id]
        if self.on_release is not None:
            self.on_release(reservation)

    def reserved_blocks(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        return tenant.blocks if tenant else 0

    def inflight(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        return tenant.inflight if tenant else 0

    def sessions(self, tenant_id: str) -> frozenset[str]:
        """The tenant's sessions with a request in flight."""
        tenant = self._tenants.get(tenant_id)
        return frozenset(tenant.sessions) if tenant else frozenset()

    def held_prefix(self, tenant_id: str) -> Container[int]:
        """Fingerprints of prefix blocks the tenant's in-flight requests hold."""
        tenant = self._tenants.get(tenant_id)
        return tenant.prefix if tenant else ()

    def tenants(self) -> list[str]:
        return list(self._tenants)
