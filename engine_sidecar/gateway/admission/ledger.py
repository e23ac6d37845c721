"""Outstanding KV-block reservations and in-flight requests, per tenant.

A reservation holds the fingerprints of its prompt's full blocks (`prefix`), the further
blocks it takes now (`extra`: the partial last block, tokens decoded so far, further
sequences) and what it may still grow (`remainder`). A tenant's committed blocks are its
distinct prefix blocks plus its extras, as vLLM's prefix cache holds them; its reserved
blocks add one joint bound on its requests' growth (`joint_charge`). A request that
decodes moves its tenant's sums by the difference: O(1), never a pass over the tenant.

Single event loop, no awaits inside: a check in `rules.decide` followed by `reserve()`
is atomic. Each Reservation releases exactly once, whichever outcome comes first, so
totals return to zero; `version` changes with every reservation and release, so views
derived from the ledger can be cached until it moves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Container
from types import TracebackType
from typing import TYPE_CHECKING

from engine_sidecar.gateway.admission.joint_charge import NO_GROWTH, Remainder, RequestGrowth

if TYPE_CHECKING:
    from engine_sidecar.gateway.admission.decode_pace import DecodePace


class Reservation:
    __slots__ = ("_ledger", "above_max", "decoded", "extra", "growth", "max_output",
                 "outcome", "prefix", "released", "remainder", "seen", "sequences", "session",
                 "started", "tenant_id")

    def __init__(
        self, ledger: Ledger, tenant_id: str, extra: int, session: str | None,
        prefix: tuple[int, ...], remainder: Remainder = NO_GROWTH,
        growth: RequestGrowth | None = None, above_max: bool = False,
        started: float = 0.0, max_output: int = 0, sequences: int = 1,
    ) -> None:
        self._ledger = ledger
        # When it was admitted (the queue's clock), the most output tokens it may decode
        # over all its `sequences`, and the tokens seen decoded: when it will end (`ends_in`).
        self.started = started
        self.max_output = max_output
        self.sequences = sequences
        self.seen = 0
        self.above_max = above_max  # admitted beyond its tenant's maxBlocks
        self.tenant_id = tenant_id
        self.extra = extra
        self.prefix = prefix
        self.session = session
        self.remainder = remainder
        self.growth = growth  # None: its remainder stays what it was admitted with
        self.decoded = 0
        self.released = False
        self.outcome: str | None = None

    @property
    def blocks(self) -> int:
        """The request's own footprint now (shared prefix blocks included)."""
        return len(self.prefix) + self.extra

    @property
    def turn_blocks(self) -> int:
        """What the whole request may come to: its footprint now plus its remainder at
        its own 90th percentile (max_tokens for a `Full` tier)."""
        return self.blocks + math.ceil(self.remainder.quantile - 1e-9)

    def progress(self, decoded: int) -> None:
        """It has decoded `decoded` output tokens over all its sequences: it takes the
        blocks they fill and its remainder is re-estimated from that point. Once per
        block each sequence fills (`RequestGrowth.step`), so a feed may call it per
        token: in between, its take moves by at most one block per sequence."""
        self.seen = decoded
        growth = self.growth
        if self.released or growth is None or decoded < self.decoded + growth.step:
            return
        self.decoded = decoded
        extra, remainder = growth.at(decoded)
        self._ledger._move(self, extra, remainder)

    def regrow(self, growth: RequestGrowth) -> None:
        """Its prompts were counted after it was admitted on a ceiling of their size: its
        take and remainder follow `growth` (the exact counts) from here on."""
        if self.released:
            return
        self.growth = growth
        extra, remainder = growth.at(self.decoded)
        self._ledger._move(self, extra, remainder)

    def ends_in(self, now: float, pace: DecodePace | None = None) -> float | None:
        """Seconds until it has decoded all it may (`max_output`), at the rate it has
        decoded so far: a bound on when it gives its blocks back. Before it has decoded
        a token (a response not streamed never says), at the engine's `pace`: its first
        token and the rest of its max_tokens per sequence, less the time it has run
        (never below 0). None when neither is known."""
        elapsed = now - self.started
        if self.max_output <= 0:
            return None
        if self.seen > 0 and elapsed > 0:
            return max(0, self.max_output - self.seen) * elapsed / self.seen
        lasts = None if pace is None else pace.lasts(
            math.ceil(self.max_output / max(1, self.sequences)))
        return None if lasts is None else max(0.0, lasts - max(0.0, elapsed))

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
    __slots__ = ("beyond", "extra", "growth", "inflight", "live", "prefix", "sessions")

    def __init__(self) -> None:
        self.live: set[Reservation] = set()  # its reservations not released yet
        self.beyond = 0  # the footprint of its requests admitted beyond its maxBlocks
        self.prefix: Counter[int] = Counter()  # fingerprint -> reservations holding it
        self.extra = 0
        self.growth = NO_GROWTH  # the sum of its requests' remainders
        self.inflight = 0
        self.sessions: Counter[str] = Counter()

    @property
    def committed(self) -> int:
        return len(self.prefix) + self.extra

    @property
    def blocks(self) -> int:
        return self.committed + self.growth.bound


class Ledger:
    def __init__(self, on_release: Callable[[Reservation], None] | None = None) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self.total_blocks = 0
        self.total_inflight = 0
        self.version = 0
        self.on_release = on_release

    def reserve(
        self, tenant_id: str, extra: int, session: str | None = None,
        prefix: tuple[int, ...] = (), remainder: Remainder = NO_GROWTH,
        growth: RequestGrowth | None = None, above_max: bool = False,
        started: float = 0.0, max_output: int = 0, sequences: int = 1,
    ) -> Reservation:
        """`remainder`: what it may still grow (none: `extra` is all it will take);
        `growth`: how `progress` re-estimates both as it decodes; `started`, `max_output`,
        `sequences`: when it was admitted, the most it may decode over all its sequences
        and how many it decodes at once (`Reservation.ends_in`)."""
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = self._tenants[tenant_id] = _Tenant()
        before = tenant.blocks
        tenant.prefix.update(prefix)
        tenant.extra += extra
        tenant.growth = tenant.growth + remainder
        tenant.inflight += 1
        if session is not None:
            tenant.sessions[session] += 1
        reservation = Reservation(self, tenant_id, extra, session, prefix, remainder, growth,
                                  above_max, started, max_output, sequences)
        tenant.live.add(reservation)
        if above_max:
            tenant.beyond += reservation.blocks
        self.total_blocks += tenant.blocks - before
        self.total_inflight += 1
        self.version += 1
        return reservation

    def _move(self, reservation: Reservation, extra: int, remainder: Remainder) -> None:
        if extra == reservation.extra and remainder == reservation.remainder:
            return
        tenant = self._tenants[reservation.tenant_id]
        before = tenant.blocks
        tenant.extra += extra - reservation.extra
        if reservation.above_max:
            tenant.beyond += extra - reservation.extra
        tenant.growth = tenant.growth + remainder - reservation.remainder
        reservation.extra, reservation.remainder = extra, remainder
        self.total_blocks += tenant.blocks - before
        self.version += 1

    def _give_back(self, reservation: Reservation) -> None:
        tenant = self._tenants[reservation.tenant_id]
        tenant.live.discard(reservation)
        before = tenant.blocks
        held = tenant.prefix  # one pass (Counter.subtract is a Python loop of its own)
        for fingerprint in reservation.prefix:
            left = held[fingerprint] - 1
            if left > 0:
                held[fingerprint] = left
            else:
                held.pop(fingerprint, None)
        tenant.extra -= reservation.extra
        if reservation.above_max:
            tenant.beyond -= reservation.blocks
        tenant.growth = tenant.growth - reservation.remainder
        tenant.inflight -= 1
        if reservation.session is not None:
            tenant.sessions[reservation.session] -= 1
            if tenant.sessions[reservation.session] <= 0:
                del tenant.sessions[reservation.session]
        self.total_blocks += tenant.blocks - before
        self.total_inflight -= 1
        self.version += 1
        if tenant.inflight == 0:
            # Its float sums may keep a rounding residue: nothing is left to charge.
            self.total_blocks -= tenant.blocks
            del self._tenants[reservation.tenant_id]
        if self.on_release is not None:
            self.on_release(reservation)

    def reserved_blocks(self, tenant_id: str) -> int:
        """What the ledger charges the tenant: committed blocks plus its joint bound."""
        tenant = self._tenants.get(tenant_id)
        return tenant.blocks if tenant else 0

    def committed_blocks(self, tenant_id: str) -> int:
        """The blocks its requests take now (prompts and tokens decoded so far)."""
        tenant = self._tenants.get(tenant_id)
        return tenant.committed if tenant else 0

    def growth(self, tenant_id: str) -> Remainder:
        """The sum of its requests' remainders (its `bound` is what they are charged)."""
        tenant = self._tenants.get(tenant_id)
        return tenant.growth if tenant else NO_GROWTH

    def beyond_max_blocks(self, tenant_id: str) -> int:
        """The footprint of the tenant's requests admitted beyond its maxBlocks."""
        tenant = self._tenants.get(tenant_id)
        return tenant.beyond if tenant else 0

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

    def live(self, tenant_id: str) -> list[Reservation]:
        """The tenant's reservations not released yet."""
        tenant = self._tenants.get(tenant_id)
        return list(tenant.live) if tenant is not None else []
