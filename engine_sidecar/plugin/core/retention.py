"""Retention order: which cached prefixes vLLM evicts first under churn.

vLLM's free queue is one LRU over every tenant's cached blocks. When a burst churns
through the cache faster than leased tenants' sessions come back, the blocks that
finished requests of tenants without leases leave go to the front of the queue, so
the leased tenants' unpinned prefixes last longer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine_sidecar.plugin.core.engine_port import Block, Engine
from engine_sidecar.plugin.core.tenant_state import TenantState


class RetentionOrder:
    """Which cache vLLM should evict first: tenants without leases before the others.

    vLLM's free queue is one LRU over every tenant's cached blocks. While the block it
    evicts next was freed longer ago than the leased tenants' sessions typically pause,
    the cache it flushes would rarely have been reused, LRU is right and is left alone.
    Once that horizon is shorter (a free-tier burst churning through the cache, say),
    the unleased cache of a premium session is usually gone before the session comes
    back: then the blocks a finished request of a tenant without leases leaves go to
    the front of the queue instead, so the next allocations take those first
    (`contended`). `protect_s` is the longest typical pause among the leased tenants.
    """

    def __init__(self) -> None:
        self._freed_at: dict[int, float] = {}  # block id -> when it was last freed

    def freed(self, block_ids: Iterable[int], now: float) -> None:
        freed_at = self._freed_at
        for block_id in block_ids:
            freed_at[block_id] = now

    def contended(self, next_evicted: int | None, now: float, protect_s: float) -> bool:
        if next_evicted is None:
            return False
        return now - self._freed_at.get(next_evicted, -math.inf) < protect_s


class Retention:
    """Applies the retention order to the blocks finished requests and leases leave."""

    def __init__(self, state: TenantState, engine: Engine) -> None:
        self._state = state
        self._engine = engine
        self._order = RetentionOrder()
        self._protect_s = 0.0  # RetentionOrder's protect_s; 0: no tenant has leases
        self._protect_until = 0.0  # when to recompute it (pauses move slowly)

    def policy_changed(self) -> None:
        self._protect_until = 0.0

    def freed(self, blocks: Iterable[Block], now: float) -> None:
        self._order.freed(map(self._engine.block_id, blocks), now)

    def request_freed(self, tenant: str | None, blocks: list[Block], now: float) -> None:
        """A finished request of `tenant` left `blocks` (in prefix order) to the LRU."""
        if self._evict_first(tenant, now):
            self._engine.evict_first(reversed(blocks))
        self.freed(blocks, now)

    def _evict_first(self, tenant: str | None, now: float) -> bool:
        """Should the blocks a finished request of `tenant` leaves go to the front of
        vLLM's free queue?"""
        policy = self._state.policy
        tenant_policy = policy.tenant(tenant) if policy is not None else None
        if tenant_policy is None or tenant_policy.lease.seconds > 0:
            return False
        assert policy is not None
        if now >= self._protect_until:
            pauses = self._state.pauses
            self._protect_s = max(
                (min(t.lease.seconds, pauses.typical_pause(t.tenant_id)
                     or t.lease.seconds / pauses.PAUSE_FACTOR)
                 for t in policy.tenants.values() if t.lease.seconds > 0),
                default=0.0,
            )
            self._protect_until = now + 1.0
        return self._protect_s > 0 and self._order.contended(
            self._engine.next_evicted_block_id(), now, self._protect_s
        )
