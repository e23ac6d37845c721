"""What an admitted request will still decode: learned per tenant and route.

Clients leave `max_tokens` generous or unset while real answers are a few hundred
tokens, so a tier whose `reservation` is `Estimated` reserves the output its tenant's
requests on the route usually produce, learned from the responses the sidecar relays
(`observe`, fed by the relay's output meter; the twin feeds the same call). The
estimate is the 90th percentile (nearest rank) of the latest `WINDOW` lengths, capped
by `max_tokens`: per route once it has `MIN_SAMPLES`, else the tenant's over all
routes, else the tier's `defaultMaxTokens`. `outlook` also gives the chance a request is
still decoding at each point ahead (`HORIZON`), for `joint_charge`. Lengths are per
sequence; memory is `WINDOW` integers per tenant and route the policy names. Why a
high quantile, a window of 64 and per route: docs/gateway.md (admission).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from engine_sidecar.contract.policy import EnginePolicy, ReservationMode, TenantPolicy

WINDOW = 64  # latest output lengths kept per tenant and route
MIN_SAMPLES = 8  # below this the window says too little; the tier default applies
QUANTILE = 0.9
ALL_ROUTES = ""  # the key of a tenant's samples over every route
TAIL_MIN = 4  # fewer samples than this beyond a point: the tail's shape stands in


# Points ahead (tokens each sequence may still decode) where a tenant's joint growth is
# read (`joint_charge`): from one 16-token block on, sqrt(2) apart, to 32,768 tokens.
HORIZON = tuple(round(16 * 2 ** (j / 2)) for j in range(22))


@dataclass(frozen=True, slots=True)
class Outlook:
    """The output one sequence of a request still has to decode, in tokens, given what it
    has decoded so far: its expected value, variance and 90th percentile; the chance
    that it is still decoding `HORIZON[j]` tokens from now (`survival`) and the samples
    that chance was read from (`samples`: its standard error is sqrt(s (1 - s) /
    samples); the window is one sample for every request of the tenant, so errors add up
    linearly, not in quadrature). `survival` empty: the remainder is known (`exactly`)."""

    mean: float
    var: float
    quantile: float
    survival: tuple[float, ...] = ()
    samples: int = 0

    @property
    def known(self) -> bool:
        return not self.survival

    def capped(self, room: int) -> Outlook:
        """Within the `room` its max_tokens leaves: the mean and quantile cut there, the
        variance at most room^2 / 4 (the widest a variable within [0, room] can spread),
        and no sequence decoding `room` tokens or more from now."""
        room = max(0, room)
        if self.known:
            return Outlook.exactly(min(int(self.mean), room))
        survival = tuple(s if ahead < room else 0.0
                         for s, ahead in zip(self.survival, HORIZON, strict=True))
        return Outlook(min(self.mean, room), min(self.var, room * room / 4),
                       min(self.quantile, room), survival, self.samples)

    @classmethod
    def exactly(cls, tokens: int) -> Outlook:
        """A known remainder (a `Full` reservation, or the tier's declared default)."""
        return cls(float(max(0, tokens)), 0.0, float(max(0, tokens)))


def _rank(count: int) -> int:
    """Nearest rank of the QUANTILE among `count` ordered samples: ceil(q * n), 1-based."""
    return max(1, int(-(-count * QUANTILE // 1)))


@dataclass
class _Window:
    """The latest output lengths of one tenant on one route, sorted with their suffix
    sums, so the remainder beyond any point is a binary search, not a scan."""

    lengths: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    quantile: int | None = None  # None until MIN_SAMPLES
    ordered: list[int] = field(default_factory=list)
    above: list[float] = field(default_factory=list)  # above[j] = sum(ordered[j:])
    above_sq: list[float] = field(default_factory=list)  # of squares
    fresh: Outlook | None = None  # beyond(0), until the window moves

    def add(self, tokens: int) -> None:
        self.lengths.append(tokens)
        self.fresh = None
        if len(self.lengths) >= MIN_SAMPLES:
            ordered = self.ordered = sorted(self.lengths)
            self.quantile = ordered[_rank(len(ordered)) - 1]
            above, above_sq, total, total_sq = [0.0], [0.0], 0.0, 0.0
            for length in reversed(ordered):
                total += length
                total_sq += length * length
                above.append(total)
                above_sq.append(total_sq)
            self.above, self.above_sq = above[::-1], above_sq[::-1]

    def beyond(self, decoded: int) -> Outlook:
        """L - d given L > d over the window's lengths L (d = `decoded`), and the share of
        those still decoding at each point of `HORIZON`. Past the longest few (fewer than
        TAIL_MIN longer), the last TAIL_MIN stand in, measured from the length just below
        them: such a request is expected to grow as much again as the longest answers
        grew past that point (a tail that does not thin)."""
        ordered = self.ordered
        count = len(ordered)
        start = bisect_right(ordered, decoded)
        origin = decoded
        if count - start < TAIL_MIN:
            start = max(0, count - TAIL_MIN)
            origin = ordered[start - 1] if start > 0 else 0
        tail = count - start
        mean_length = self.above[start] / tail
        var = max(0.0, self.above_sq[start] / tail - mean_length * mean_length)
        quantile = ordered[start + _rank(tail) - 1]
        survival = []
        for ahead in HORIZON:
            alive = count - bisect_right(ordered, origin + ahead, start)
            survival.append(alive / tail)
            if not alive:
                survival.extend([0.0] * (len(HORIZON) - len(survival)))
                break
        return Outlook(mean_length - origin, var, max(0.0, quantile - origin),
                       tuple(survival), tail)


class OutputEstimates:
    """Per tenant and route: the output tokens an `Estimated` reservation counts."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], _Window] = {}

    def observe(self, tenant_id: str, route: str, output_tokens: int, n: int = 1) -> None:
        """A response of `tenant_id` on `route` finished with `output_tokens` in all."""
        if output_tokens < 0 or n < 1:
            raise ValueError(f"output_tokens must be >= 0 and n >= 1, got {output_tokens}, {n}")
        per_sequence = -(-output_tokens // n)
        for key in dict.fromkeys(((tenant_id, route), (tenant_id, ALL_ROUTES))):
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = _Window()
            window.add(per_sequence)

    def learned(self, tenant_id: str, route: str) -> int | None:
        """The learned estimate (None: fewer than MIN_SAMPLES finished)."""
        for key in ((tenant_id, route), (tenant_id, ALL_ROUTES)):
            window = self._windows.get(key)
            if window is not None and window.quantile is not None:
                return window.quantile
        return None

    def outlook(
        self, tenant: TenantPolicy, route: str, policy: EnginePolicy, decoded: int = 0,
    ) -> Outlook | None:
        """What one sequence of a request of `tenant` on `route` that has decoded
        `decoded` tokens is expected to decode still, before its max_tokens caps it:
        the tenant's learned lengths beyond that point (route, then all routes), else
        the tier default less what it decoded; None: its tier reserves `Full`."""
        if policy.reservation_for(tenant.tier) is ReservationMode.FULL:
            return None
        for key in ((tenant.tenant_id, route), (tenant.tenant_id, ALL_ROUTES)):
            window = self._windows.get(key)
            if window is not None and window.quantile is not None:
                if decoded:
                    return window.beyond(decoded)
                if window.fresh is None:
                    window.fresh = window.beyond(0)
                return window.fresh
        return Outlook.exactly(tenant.default_max_tokens - decoded)

    def samples(self, tenant_id: str) -> int:
        window = self._windows.get((tenant_id, ALL_ROUTES))
        return len(window.lengths) if window else 0

    def output_tokens(self, tenant: TenantPolicy, route: str, policy: EnginePolicy) -> int | None:
        """What a request of `tenant` on `route` reserves for its output, before the cap
        of its own max_tokens; None: its tier reserves `Full` (max_tokens)."""
        if policy.reservation_for(tenant.tier) is ReservationMode.FULL:
            return None
        learned = self.learned(tenant.tenant_id, route)
        return tenant.default_max_tokens if learned is None else learned

    def in_use(self, tenant: TenantPolicy, policy: EnginePolicy, route: str = ALL_ROUTES) -> int:
        """The output tokens a request of `tenant` on `route` reserves now, before its
        own max_tokens caps it (a `Full` tier: the tenant's maxTokens ceiling)."""
        tokens = self.output_tokens(tenant, route, policy)
        return tenant.max_tokens if tokens is None else tokens

    def routes(self, tenant_id: str) -> list[str]:
        """The routes the tenant has finished requests on (`ALL_ROUTES` excluded)."""
        return sorted(r for t, r in self._windows if t == tenant_id and r != ALL_ROUTES)

    def retain(self, tenants: Container[str]) -> None:
        """Forget tenants the policy no longer names."""
        for key in [k for k in self._windows if k[0] not in tenants]:
            del self._windows[key]
