"""Whether a tenant's own pool-wide maxBlocks is what held it back in a pool run.

When KVQuota gives the protected tier a worse p99 than stock priority, either the
tenant's declared pool-wide maxBlocks binds (stock priority has no such cap) or
admission refused it while it had room. Per tenant, over the load window, sampled
every `SAMPLE_S` of virtual time: seconds its held blocks (running requests and leases,
summed over the engines) were at its pool-wide maxBlocks (`CEILING_SHARE` of it or
more, as for one engine in `occupancy`) and above it, its peak; seconds some request of
it was queued, and of those, seconds its pool-wide charge was below `CEILING_SHARE` of
maxBlocks (queued with room); and, per 429 on its maxBlocks, whether the request fit
under the pool-wide maxBlocks beside what the engines charged it then (refused with
room). With room, the queue or the store held it, not its quota.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvquota_lab.bench.occupancy import CEILING_SHARE

SAMPLE_S = 1.0


@dataclass
class _Tenant:
    tier: str
    max_blocks: int  # pool-wide
    at_max: float = 0.0
    above_max: float = 0.0
    peak_held: int = 0
    queued: float = 0.0
    queued_with_room: float = 0.0
    refused: int = 0
    refused_with_room: int = 0


class PoolCeilings:
    def __init__(self, window: float, limits: Mapping[str, tuple[str, int]]) -> None:
        """`limits`: tenant -> (tier, pool-wide maxBlocks); `window`: the load window."""
        self.window = window
        self._tenants = {t: _Tenant(tier, blocks) for t, (tier, blocks) in limits.items()}
        self._at = 0.0

    def sample(self, now: float, held: Mapping[str, int], charged: Mapping[str, int],
               queued: Mapping[str, int]) -> None:
        """The pool as it stands at `now`, taken to have stood since the last sample."""
        seconds = max(0.0, min(now, self.window) - self._at)
        self._at = max(self._at, min(now, self.window))
        for tenant_id, t in self._tenants.items():
            blocks = held.get(tenant_id, 0)
            t.peak_held = max(t.peak_held, blocks)
            if seconds <= 0:
                continue
            if blocks >= CEILING_SHARE * t.max_blocks:
                t.at_max += seconds
            if blocks > t.max_blocks:
                t.above_max += seconds
            if queued.get(tenant_id, 0):
                t.queued += seconds
                if charged.get(tenant_id, 0) < CEILING_SHARE * t.max_blocks:
                    t.queued_with_room += seconds

    def refused(self, tenant_id: str, charged: int, blocks: int) -> None:
        """A request of the tenant was refused (429) on its maxBlocks."""
        t = self._tenants.get(tenant_id)
        if t is None:
            return
        t.refused += 1
        if charged + blocks <= t.max_blocks:
            t.refused_with_room += 1

    def to_json(self) -> dict[str, Any]:
        return {
            tenant_id: {
                "tier": t.tier, "maxBlocks": t.max_blocks,
                "secondsAtMaxBlocks": round(t.at_max, 1),
                "secondsAboveMaxBlocks": round(t.above_max, 1),
                "peakHeld": t.peak_held,
                "secondsQueued": round(t.queued, 1),
                "secondsQueuedWithRoom": round(t.queued_with_room, 1),
                "refusedOnMaxBlocks": t.refused,
                "refusedWithRoom": t.refused_with_room,
            }
            for tenant_id, t in sorted(self._tenants.items())
        }
