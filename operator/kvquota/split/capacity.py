"""Pool capacity, the per-replica split of quotas, and oversubscription admission.

Quotas are pool-wide; every engine enforces its share. Guarantees are floor-divided
(the engines never promise more than the pool admitted), ceilings ceil-divided (the
pool can serve the whole ceiling), and an engine's maximum is never below its
guarantee. Admission is Kueue's StrictFIFO: oldest first, each takes its guarantee
while the total fits in `capacity * (1 - watermark)`, and once one does not fit every
newer quota with a guarantee waits. Why: docs/operator.md, "The even split and
admission".
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


def ceil_div(value: int, parts: int) -> int:
    return -(-value // parts)


@dataclass(frozen=True)
class Split:
    guaranteed: int
    maximum: int


def split_quota(guaranteed: int, maximum: int, replicas: int) -> Split:
    """Per-engine share of a pool-wide quota (see the module docstring for rounding)."""
    parts = max(replicas, 1)
    per_guaranteed = guaranteed // parts
    return Split(per_guaranteed, max(ceil_div(maximum, parts), per_guaranteed))


def split_ceiling(value: int | None, replicas: int) -> int | None:
    """Per-engine share of a pool-wide cap where 0/None mean "no cap"."""
    if not value:
        return value
    return ceil_div(value, max(replicas, 1))


def engine_capacity(override: int | None, reported: Iterable[int]) -> int | None:
    """KV blocks per engine: the pool's override, else the smallest report of a ready
    engine (the pool is only as roomy as its smallest replica); None when unknown."""
    if override:
        return override
    sizes = [blocks for blocks in reported if blocks > 0]
    return min(sizes) if sizes else None


def guaranteeable_blocks(capacity_per_engine: int, replicas: int, watermark: float) -> int:
    """Pool-wide blocks that may be guaranteed: the watermark stays free for borrowing."""
    return math.floor(capacity_per_engine * max(replicas, 1) * (1.0 - watermark))


@dataclass(frozen=True)
class Admission:
    accepted: bool
    waiting_behind: Hashable | None = None  # the older quota that did not fit first
    granted_before: int = 0  # blocks already guaranteed to older quotas when decided


def admit_oldest_first(
    requests: Sequence[tuple[Hashable, int]], budget: int
) -> dict[Hashable, Admission]:
    """StrictFIFO admission of `(key, guaranteedBlocks)` given oldest first."""
    decisions: dict[Hashable, Admission] = {}
    granted = 0
    blocker: Hashable | None = None
    for key, blocks in requests:
        if blocks == 0:
            decisions[key] = Admission(True, granted_before=granted)
        elif blocker is None and granted + blocks <= budget:
            decisions[key] = Admission(True, granted_before=granted)
            granted += blocks
        else:
            blocker = key if blocker is None else blocker
            decisions[key] = Admission(
                False,
                waiting_behind=None if blocker == key else blocker,
                granted_before=granted,
            )
    return decisions
