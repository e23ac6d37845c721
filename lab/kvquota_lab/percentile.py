"""The one percentile rule of the lab's reports.

`percentile(values, q)`: q in percent (0..100), linear interpolation between the two
order statistics around rank `(n - 1) * q / 100` (numpy's default, R's type 7, and
`statistics.quantiles(method="inclusive")`), None for no data.

Why this rule: it is continuous in q and in the samples, so a p99 over a few hundred
requests moves with the slow tail instead of jumping between two samples as a nearest
rank does, and p0/p100 are the minimum and maximum whatever the count. It is also what
anyone checking a figure with numpy or pandas gets, so the lab's numbers compare with
theirs without a footnote.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) of `values`, None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
