"""One charge per tenant for its requests together: what they take now plus a joint
bound on how far they will still grow (README: reservations).

Requests in flight are the long ones, so charging each its 90th-percentile output, or
its whole remainder, charges a tenant as if none would ever finish, while the blocks
they hold together hardly grow: as some grow, others finish and give theirs back. The
bound is the peak, over the tokens ahead (`HORIZON`), of their expected joint growth
plus Z standard deviations, finishers giving their own blocks back; it is capped by the
sum of their 90th-percentile remainders, which is the bound itself with fewer than
MIN_JOINT in flight. A known remainder (`Full` tiers) counts in full. A handful of sums
per tenant, moved by each request's delta, so admission reads the charge in O(1). The
formula and why each term: docs/gateway.md (admission).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from engine_sidecar.gateway.admission.output_estimate import HORIZON, Outlook

Z = 2.0  # one-sided normal: ~97.7% confidence that the tenant's requests fit together

# Below this many estimated requests in flight, their own 90th percentiles: a normal
# margin over one or two all-or-nothing finishes holds only ~80% of the time.
MIN_JOINT = 4

_Points = tuple[float, ...]


def _plus(a: _Points, b: _Points, sign: float = 1.0) -> _Points:
    if not b:
        return a
    if not a:
        return b if sign > 0 else tuple(map(operator.neg, b))
    return tuple(map(operator.add if sign > 0 else operator.sub, a, b))


@dataclass(frozen=True, slots=True)
class Remainder:
    """A request's (or a tenant's summed) growth still to come, in blocks: `known` in
    full; for estimated ones, per point of `HORIZON`, the expected growth (`grown`,
    finishers' blocks given back), its variance, the window's error on it, and the
    most it can be (`most`: every one still decoding); `mean` and `quantile` sum their
    expected and 90th-percentile remainders (known ones included in `quantile`)."""

    known: float = 0.0
    count: int = 0  # estimated requests summed
    mean: float = 0.0
    quantile: float = 0.0
    grown: _Points = ()
    var: _Points = ()
    error: _Points = ()
    most: _Points = ()

    def __add__(self, other: Remainder) -> Remainder:
        return Remainder(
            self.known + other.known, self.count + other.count, self.mean + other.mean,
            self.quantile + other.quantile,
            _plus(self.grown, other.grown), _plus(self.var, other.var),
            _plus(self.error, other.error), _plus(self.most, other.most))

    def __sub__(self, other: Remainder) -> Remainder:
        return Remainder(
            self.known - other.known, self.count - other.count, self.mean - other.mean,
            self.quantile - other.quantile,
            _plus(self.grown, other.grown, -1), _plus(self.var, other.var, -1),
            _plus(self.error, other.error, -1), _plus(self.most, other.most, -1))

    @property
    def peak(self) -> float:
        """The bound on the estimated requests' joint growth (blocks, fractional)."""
        peak = 0.0
        sqrt = math.sqrt
        for grown, var, error, most in zip(self.grown, self.var, self.error, self.most,
                                           strict=True):
            spread = var + error * error  # may drift below 0 by rounding as sums move
            top = grown + Z * sqrt(spread) if spread > 0 else grown
            if top > most:
                top = most
            if top > peak:
                peak = top
        return peak

    @property
    def bound(self) -> int:
        """The joint bound in whole blocks (the formula: docs/gateway.md, admission)."""
        if self.count < MIN_JOINT:
            return max(0, math.ceil(self.quantile - 1e-9))
        return max(0, math.ceil(min(self.quantile, self.known + self.peak) - 1e-9))


NO_GROWTH = Remainder()


@lru_cache(maxsize=4096)  # a queued request is decided again at every pump
def in_blocks(
    outlook: Outlook, prompts: tuple[int, ...], n: int, decoded: int, block_size: int,
    held: int = 0,
) -> Remainder:
    """The remainder of a request whose `n` sequences per prompt have each decoded
    `decoded` tokens with this per-sequence outlook, in blocks; `held`: the blocks it
    gives back when it finishes. What fits in the free slots of each sequence's last
    block is not new blocks."""
    slacks = [-(prompt + decoded) % block_size for prompt in prompts or (0,)]
    if outlook.known:
        whole = sum(n * float(-(-max(0.0, outlook.mean - slack) // block_size))
                    for slack in slacks)
        return Remainder(known=whole, quantile=whole)
    mean = sum(n * max(0.0, outlook.mean - slack) for slack in slacks) / block_size
    quantile = sum(n * max(0.0, outlook.quantile - slack) for slack in slacks) / block_size
    grown: list[float] = []
    var: list[float] = []
    error: list[float] = []
    most: list[float] = []
    samples = max(1, outlook.samples)
    single = len(slacks) == 1
    first = slacks[0]
    for alive, ahead in zip(outlook.survival, HORIZON, strict=True):
        if alive <= 0:  # done by then, and by every later point: it gave its blocks back
            rest = len(HORIZON) - len(grown)
            grown.extend([-float(held)] * rest)
            var.extend([0.0] * rest)
            error.extend([0.0] * rest)
            most.extend([-float(held)] * rest)
            break
        if single:
            growth = n * (ahead - first) / block_size if ahead > first else 0.0
        else:
            growth = sum(n * max(0, ahead - slack) for slack in slacks) / block_size
        swing = growth + held
        spread = alive * (1.0 - alive)
        grown.append(growth * alive - held * (1.0 - alive))
        var.append(swing * swing * spread)
        error.append(swing * math.sqrt(spread / samples))
        most.append(growth)
    return Remainder(0.0, 1, mean, quantile, tuple(grown), tuple(var), tuple(error),
                     tuple(most))


class RequestGrowth:
    """One admitted request as it decodes: the blocks beyond its prompt's full blocks it
    takes now (prompt tail and decoded tokens, per sequence: what it gives back when it
    finishes) and its remainder. The outlook comes from its tenant's estimates at each
    update (`outlook(d)`: per sequence, `d` tokens decoded, capped by its max_tokens)."""

    __slots__ = ("_outlook", "block_size", "full_blocks", "n", "prompts", "sequences", "step")

    def __init__(self, prompts: tuple[int, ...], n: int, full_blocks: int, block_size: int,
                 outlook: Callable[[int], Outlook]) -> None:
        self.prompts = prompts
        self.n = max(1, n)
        self.sequences = self.n * max(1, len(prompts))
        self.full_blocks = full_blocks  # the prompt's full blocks the ledger counts apart
        self.block_size = block_size
        self.step = self.sequences * block_size  # decoded tokens between re-estimates
        self._outlook = outlook

    def at(self, decoded: int) -> tuple[int, Remainder]:
        """(blocks beyond the prompt's full blocks, remainder) after `decoded` output
        tokens over all its sequences."""
        per_sequence = max(0, decoded) // self.sequences
        size, n = self.block_size, self.n
        taken = sum(n * -(-(p + per_sequence) // size) for p in self.prompts or (0,))
        extra = max(0, taken - self.full_blocks)
        remainder = in_blocks(self._outlook(per_sequence), self.prompts, n, per_sequence,
                              size, extra)
        return extra, remainder
