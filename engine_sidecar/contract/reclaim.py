"""The victim order read the other way: what a new request may count on.

The plugin's victim order (`engine_sidecar.plugin.rules.ranking`) gives blocks back
by (band, tier); the sidecar admits a request into the free blocks above the watermark
plus what that order would give back before it (`reclaimable_blocks`). Both sides
import this module, so admission never counts on blocks preemption would not free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum


def watermark_floor(watermark: float, total_blocks: int) -> int:
    """The free blocks the watermark keeps for guaranteed capacity: a borrower may not
    take the engine's free count below this."""
    return math.ceil(watermark * total_blocks)


class Band(IntEnum):
    """Coarse victim class; a larger value gives blocks back first."""

    GUARANTEED = 1
    BORROWER = 2
    ABOVE_MAX = 3  # beyond its maxBlocks, in KV nobody else wanted (aboveMax: Reclaimable)
    UNCLASSIFIED = 4


@dataclass(frozen=True, slots=True)
class Holding:
    """One tenant's KV on an engine, as the victim order sees it (plain counts).

    `guaranteed` is the tenant's guarantee on this engine (its split of the pool-wide
    one); `used` is what counts against it (blocks held plus growth its admitted
    requests may still allocate); `held` is what it holds now, running and pinned,
    i.e. what preemption and lease releases can actually free; `idle_leased` is the
    part of `held` pinned by leases of sessions with no request in flight;
    `above_max` is the part of `held` its requests admitted beyond its maxBlocks hold.
    """

    priority: int
    guaranteed: int
    used: int
    held: int
    idle_leased: int
    above_max: int = 0


def quota_band(used: int, guaranteed_per_engine: int) -> Band:
    """The borrower rule (Kueue's nominal quota): a tenant whose usage on this engine
    passes its guarantee there is borrowing, else it is within its guarantee. The
    victim order ranks a tenant's running work and leases by it, admission a new
    request (`requester_band`)."""
    return Band.BORROWER if used > guaranteed_per_engine else Band.GUARANTEED


def requester_band(used: int, blocks: int, guaranteed_per_engine: int,
                   max_blocks_per_engine: int | None = None) -> Band:
    """The class of a new request of `blocks`: the band its tenant would be in once it
    holds them, or above-max work if that passes `max_blocks_per_engine` (given only
    when the tenant may run work beyond it). `used` leaves out the tenant's idle
    leases, which yield to its own new work."""
    if max_blocks_per_engine is not None and used + blocks > max_blocks_per_engine:
        return Band.ABOVE_MAX
    return quota_band(used + blocks, guaranteed_per_engine)


def reclaimable_blocks(
    band: Band,
    priority: int,
    holdings: Iterable[Holding],
    *,
    unclassified: int = 0,
    own: Holding | None = None,
) -> int:
    """Blocks the victim order gives back before a new request of class (band, priority).

    This is the admission rule that agrees with preemption: a request may count on the
    free blocks above the watermark plus what this returns. A new request has computed
    nothing, so within its own (band, tier) it outranks every running request, and only
    these rank above it: unclassified traffic; the part of every other tenant's usage
    whose (band, tier) ranks above it, where a tenant is a borrower only for its blocks
    above its guarantee (once back within it, its band changes); the idle leases of
    tenants whose leases rank above it (leases go before running work of the same
    class); and, whatever the classes, the requester's own tenant's idle leases (`own`),
    because a tenant's cache never stands in the way of its own new work.
    """
    request_key = (band, priority, 0)
    total = unclassified
    for holding in holdings:
        total += _reclaimable_from(holding, request_key)
    if own is not None:
        total += own.idle_leased
    return total


def _reclaimable_from(holding: Holding, request_key: tuple[int, int, int]) -> int:
    held = holding.held
    if held <= 0:
        return 0
    prio = holding.priority
    idle = min(holding.idle_leased, held)
    # Its usage in layers, top first: above its ceiling, above its guarantee, within
    # it. Each layer goes while its class ranks above the request: running work too if
    # the (band, tier) does, else only idle leases (they go before running work of the
    # same class); once a layer is given back, the tenant is in the next band.
    above = min(held, holding.above_max)
    borrowed = min(held - above, max(0, holding.used - holding.guaranteed - above))
    taken = 0
    for band, layer in ((Band.ABOVE_MAX, above), (Band.BORROWER, borrowed),
                        (Band.GUARANTEED, held - above - borrowed)):
        if (band, prio, 0) > request_key:
            taken += layer
        elif (band, prio, 1) > request_key:
            taken += min(layer, max(0, idle - taken))
    return taken
