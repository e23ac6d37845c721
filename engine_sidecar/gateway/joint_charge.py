"""One charge per tenant for its requests together: what they hold plus a joint bound on
what they will still grow (README: reservations).

Reserving each request's 90th-percentile output charges a tenant with n requests in
flight n high quantiles, while together they grow by about n times the mean: with
answers lognormal at sigma 0.8 the 90th percentile is twice the mean. Independent
requests' remainders add up the way bursty flows share a link (effective bandwidth):
the sum has mean sum(mu_i) and spread sqrt(sum(var_i)), so the bound that holds the
tenant's joint growth at the stated confidence is

    bound = min( sum(mu_i) + Z * sqrt(sum(var_i) + sum(se_i)^2),  sum(q_i) )

- mu_i, var_i, q_i: request i's remainder given what it has decoded (`Outlook`, from
  its tenant's learned lengths beyond that point), its expected value, variance and
  90th percentile, in blocks, capped by its max_tokens;
- the window's own error: mu_i is a mean over the samples beyond that point, off by
  about se_i = sqrt(var_i / count); every request of the tenant reads the same
  window, so these errors add up linearly and join the variance as (sum se_i)^2 —
  without this, 64 requests of a tenant outgrew the bound one time in eight (the
  window's mean, wrong by 12%, moves all of them together);
- Z = 2: the joint growth exceeds the bound about 2.3% of the time under the normal
  approximation; the sum of a few skewed remainders has a heavier right tail, measured
  on lognormal answers in tests/sidecar/test_joint_charge.py;
- the sum of per-request quantiles caps it: with one or two requests in flight the
  normal margin is wider than their own 90th percentiles (the rule before: about one
  request in ten outgrows it), from about four on the joint bound is the smaller.

A request that outgrows the bound is charged what it really holds (admission's
`charged` takes the larger of the ledger's count and the plugin's), draws on its
tenant's headroom, then on free blocks above the watermark, then the victim order.

Sums are kept per tenant in the ledger and moved by each request's delta as it
decodes, so admission reads the charge in O(1); each request's update is a binary
search in its tenant's window (`OutputEstimates.outlook`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine_sidecar.gateway.output_estimate import Outlook

Z = 2.0  # one-sided normal: ~97.7% confidence that the tenant's requests fit together


@dataclass(frozen=True, slots=True)
class Remainder:
    """A request's (or a tenant's summed) growth still to come, in blocks; `error`: the
    standard error of `mean` (summed linearly: one window's error is every request's)."""

    mean: float = 0.0
    var: float = 0.0
    quantile: float = 0.0
    error: float = 0.0

    def __add__(self, other: Remainder) -> Remainder:
        return Remainder(self.mean + other.mean, self.var + other.var,
                         self.quantile + other.quantile, self.error + other.error)

    def __sub__(self, other: Remainder) -> Remainder:
        return Remainder(self.mean - other.mean, self.var - other.var,
                         self.quantile - other.quantile, self.error - other.error)

    @property
    def spread(self) -> float:
        """The standard deviation of the summed growth, the estimate's error included."""
        return math.sqrt(max(0.0, self.var + self.error * self.error))

    @property
    def bound(self) -> int:
        """The joint bound in whole blocks (see the module docstring)."""
        joint = self.mean + Z * self.spread
        return max(0, math.ceil(min(joint, self.quantile) - 1e-9))

    def share(self, own: Remainder) -> float:
        """`own`'s part of this sum's bound (Euler allocation: its mean plus its part of
        the margin), in blocks; the shares of all parts add up to the bound."""
        spread = self.spread
        if self.mean + Z * spread >= self.quantile:
            return own.quantile
        if spread <= 0:
            return own.mean
        return own.mean + Z * (own.var + own.error * self.error) / spread


NO_GROWTH = Remainder()


def in_blocks(
    outlook: Outlook, prompts: tuple[int, ...], n: int, decoded: int, block_size: int,
) -> Remainder:
    """The remainder of a request whose `n` sequences per prompt have each decoded
    `decoded` tokens with this per-sequence outlook, in blocks: what fits in the free
    slots of each sequence's last block is not new blocks. A known remainder (variance
    0: `Full`, or the tier default) counts whole blocks per sequence, exactly as
    ceil((prompt + max_tokens) / blockSize) does; an estimated one counts fractions, so
    a tenant's many requests are not rounded up one by one."""
    mean = var = quantile = error = 0.0
    exact = outlook.var <= 0 and outlook.mean == outlook.quantile
    for prompt in prompts or (0,):
        slack = -(prompt + decoded) % block_size
        if exact:
            whole = float(-(-max(0.0, outlook.mean - slack) // block_size))
            mean += n * whole
            quantile += n * whole
        else:
            mean += n * max(0.0, outlook.mean - slack) / block_size
            quantile += n * max(0.0, outlook.quantile - slack) / block_size
            var += n * outlook.var / (block_size * block_size)
            error += n * outlook.error / block_size
    return Remainder(mean, var, quantile, error)


class RequestGrowth:
    """One admitted request as it decodes: the blocks beyond its prompt's full blocks it
    takes now (prompt tail and decoded tokens, per sequence) and its remainder. The
    outlook comes from its tenant's estimates at each update (`outlook(d)`: per
    sequence, `d` tokens decoded, already capped by its max_tokens)."""

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
        remainder = in_blocks(self._outlook(per_sequence), self.prompts, n, per_sequence, size)
        return max(0, taken - self.full_blocks), remainder
