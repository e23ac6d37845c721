"""Leases: the pinned prefix-cache blocks of idle sessions, by session.

When a turn of a tenant with `lease.seconds > 0` ends, its session's cached blocks
keep one extra reference until the session is back or the lease lapses, so the next
turn is a prefix-cache hit. The table here only keeps the books (expiry, per-tenant
caps, distinct blocks); whoever holds the block references takes and drops them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from engine_sidecar.contract.policy import EnginePolicy

B = TypeVar("B")  # an opaque KV block handle (vLLM's KVCacheBlock in the engine)


class LeaseDrop(StrEnum):
    """Why a lease ended without pressure (`leaseDrops` keys; not evictions)."""

    EXPIRED = "expired"
    CAP = "cap"  # lease.maxSessions / lease.maxBlocks made room for a newer session
    POLICY = "policy"  # the tenant lost its lease (or the tenant) in a policy change
    RESET = "reset"  # prefix cache reset / shutdown


@dataclass(slots=True)
class Lease(Generic[B]):
    """Pinned blocks of one idle session. The table owns one reference on each block."""

    tenant: str
    session: str
    blocks: list[B]
    last_activity: float
    expires_at: float
    pause_hold: float = math.inf  # SessionPauses.hold_seconds when the lease was taken
    pause: float | None = None  # SessionPauses.return_pause: None, no rhythm to go by

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session)

    def expected_return(self, now: float) -> float:
        """When its session should be back: one typical pause after its last activity,
        or, once overdue, one pause from now (no nearer than a fresh one). Without a
        rhythm every lease says `now`, and the caps fall back to the oldest first."""
        if self.pause is None:
            return now
        due = self.last_activity + self.pause
        return due if due > now else now + self.pause

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def lease_seconds(policy: EnginePolicy | None, tenant: str | None) -> int:
    """How long an idle session of `tenant` keeps its blocks (0: no lease)."""
    tenant_policy = policy.tenant(tenant) if policy is not None else None
    return tenant_policy.lease.seconds if tenant_policy is not None else 0


def lease_block_cap(policy: EnginePolicy | None, tenant: str) -> int:
    """The most blocks one lease of `tenant` may pin (0: no cap)."""
    tenant_policy = policy.tenant(tenant) if policy is not None else None
    return tenant_policy.lease.max_leased_blocks if tenant_policy is not None else 0


class LeaseTable(Generic[B]):
    """Leases by session, with per-tenant caps and expiry.

    The table never touches blocks itself: every method that ends leases returns them
    (with why), and the caller drops their references. `lease.maxBlocks` caps the
    distinct blocks a tenant's leases pin, as vLLM holds them: a system prompt that
    every session shares counts once, not once per session (`block_key` says which
    handles are the same block). Invariants: at most one lease per (tenant, session);
    `_pinned[tenant]` counts, per block, the tenant's leases that hold it;
    `_next_expiry` is <= every lease's `expires_at`, so `pop_expired` can skip the scan
    while nothing can have expired.
    """

    def __init__(self, block_key: Callable[[B], Hashable] = lambda block: block) -> None:
        self._leases: dict[tuple[str, str], Lease[B]] = {}
        self._pinned: dict[str, Counter[Hashable]] = {}
        self._block_key = block_key
        self._next_expiry = math.inf

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease[B]]:
        return iter(list(self._leases.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def get(self, key: tuple[str, str]) -> Lease[B] | None:
        return self._leases.get(key)

    def put(
        self, lease: Lease[B], policy: EnginePolicy | None
    ) -> list[tuple[Lease[B], LeaseDrop | None]]:
        """Add or renew a session's lease; returns the leases to release.

        The replaced lease of the same session comes back with reason None (a
        renewal, not a drop); older sessions of the tenant that no longer fit
        `lease.maxSessions` / `lease.maxBlocks` come back with reason CAP. The caller
        trims `lease.blocks` to `lease_block_cap()` before taking references.
        """
        released: list[tuple[Lease[B], LeaseDrop | None]] = []
        old = self.pop(lease.key)
        if old is not None:
            released.append((old, None))
        if lease.blocks:
            self._add(lease)
            self._next_expiry = min(self._next_expiry, lease.expires_at)
        released.extend((drop, LeaseDrop.CAP) for drop in self._enforce_caps(lease.tenant, policy))
        return released

    def touch(self, key: tuple[str, str], now: float, seconds: int) -> None:
        """A session was active: its lease lives `seconds` from now."""
        lease = self._leases.get(key)
        if lease is not None:
            lease.last_activity = now
            lease.expires_at = now + seconds
            self._next_expiry = min(self._next_expiry, lease.expires_at)

    def pop(self, key: tuple[str, str]) -> Lease[B] | None:
        lease = self._leases.get(key)
        if lease is not None:
            self._remove(lease)
        return lease

    def pop_expired(self, now: float) -> list[Lease[B]]:
        if now < self._next_expiry:
            return []
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self._remove(lease)
        self._next_expiry = min((x.expires_at for x in self._leases.values()), default=math.inf)
        return expired

    def pop_all(self) -> list[Lease[B]]:
        leases = list(self._leases.values())
        self._leases.clear()
        self._pinned.clear()
        self._next_expiry = math.inf
        return leases

    def apply_policy(self, policy: EnginePolicy | None) -> list[tuple[Lease[B], LeaseDrop]]:
        """Re-derive expiries and caps from a new policy; returns the leases it ends."""
        dropped: list[tuple[Lease[B], LeaseDrop]] = []
        for lease in list(self._leases.values()):
            seconds = lease_seconds(policy, lease.tenant)
            if seconds <= 0:
                self._remove(lease)
                dropped.append((lease, LeaseDrop.POLICY))
            else:
                lease.expires_at = lease.last_activity + min(seconds, lease.pause_hold)
        for tenant in {lease.tenant for lease in self._leases.values()}:
            dropped.extend((lease, LeaseDrop.CAP) for lease in self._enforce_caps(tenant, policy))
        self._next_expiry = min((x.expires_at for x in self._leases.values()), default=math.inf)
        return dropped

    def tenant_totals(self) -> dict[str, tuple[int, int]]:
        """tenant -> (leased sessions, leased blocks counted per lease)."""
        totals: dict[str, tuple[int, int]] = {}
        for lease in self._leases.values():
            sessions, blocks = totals.get(lease.tenant, (0, 0))
            totals[lease.tenant] = (sessions + 1, blocks + lease.num_blocks)
        return totals

    def pinned_blocks(self, tenant: str) -> int:
        """Distinct blocks the tenant's leases pin (what `lease.maxBlocks` caps)."""
        return len(self._pinned.get(tenant, ()))

    def _add(self, lease: Lease[B]) -> None:
        self._leases[lease.key] = lease
        pinned = self._pinned.setdefault(lease.tenant, Counter())
        pinned.update(map(self._block_key, lease.blocks))

    def _remove(self, lease: Lease[B]) -> None:
        del self._leases[lease.key]
        pinned = self._pinned[lease.tenant]
        for key in map(self._block_key, lease.blocks):
            if pinned[key] <= 1:
                del pinned[key]
            else:
                pinned[key] -= 1
        if not pinned:
            del self._pinned[lease.tenant]

    def _enforce_caps(self, tenant: str, policy: EnginePolicy | None) -> list[Lease[B]]:
        tenant_policy = policy.tenant(tenant) if policy is not None else None
        if tenant_policy is None:
            return []
        max_sessions = tenant_policy.lease.max_sessions
        max_blocks = tenant_policy.lease.max_leased_blocks
        if not max_sessions and not max_blocks:
            return []
        # The oldest activity goes first: with irregular (say exponential) pauses, the
        # longer a session has been idle, the likelier it is gone for good. But when a
        # tenant's sessions keep a rhythm (`SessionPauses.regular`: people reading long
        # answers), they come back in the order they left and the oldest is the next to
        # return: then the lease whose session should be back last goes first, as
        # dropping the oldest would drop the very next one to be used, every time.
        own = [lease for lease in self._leases.values() if lease.tenant == tenant]

        def over() -> bool:
            return bool(own) and bool(
                (max_sessions and len(own) > max_sessions)
                or (max_blocks and self.pinned_blocks(tenant) > max_blocks)
            )

        if not over():
            return []  # the common case: no sort
        now = max(lease.last_activity for lease in own)  # the newest lease's time
        own.sort(key=lambda lease: (-lease.expected_return(now), lease.last_activity))
        dropped: list[Lease[B]] = []
        while over():
            oldest = own.pop(0)
            self._remove(oldest)
            dropped.append(oldest)
        return dropped
