"""How long an idle session is worth its lease, learnt from its pauses.

A lease that outlives its session's return holds blocks for nothing; one that lapses
just before it costs a full recompute. The rule and its numbers are explained in
docs/scheduler-plugin.md.
"""

from __future__ import annotations

import math
from collections import deque


class SessionPauses:
    """How long an idle session is worth its lease, from the pauses it has shown.

    A lease lapses `pause_factor(n)` times the session's typical pause (an
    exponentially weighted mean of its gaps between turns, over n pauses' worth of
    evidence) after its last activity: never later than the tenant's `lease.seconds`,
    never sooner than `MIN_HOLD_S`. A session with no pause yet gets the whole
    `lease.seconds`, unless none of its tenant's last `RETURN_WINDOW` leases saw a
    return: then `MIN_HOLD_S`. The tenant's typical pause also orders retention.
    docs/scheduler-plugin.md derives the factor. Gaps are remembered for the
    `MAX_SESSIONS` most recent sessions.
    """

    PAUSE_FACTOR = 4.0
    MIN_HOLD_S = 10.0
    WEIGHT = 0.3  # of the newest gap in the mean
    MAX_SESSIONS = 65_536
    RETURN_WINDOW = 20  # a tenant's latest lease outcomes (came back or not) kept
    SPREAD_WEIGHT = 0.05  # of the newest gap in the tenant's spread (~20 gaps)
    REGULAR_SAMPLES = 20
    REGULAR_CV = 0.5

    def __init__(self) -> None:
        self._ended: dict[tuple[str, str], float] = {}  # session -> end of its last turn
        # session -> (weighted mean pause, sum of its weights squared)
        self._session_mean: dict[tuple[str, str], tuple[float, float]] = {}
        self._tenant_mean: dict[str, float] = {}
        self._returns: dict[str, deque[bool]] = {}  # tenant -> latest outcomes
        self._spread: dict[str, tuple[int, float, float]] = {}  # tenant -> n, E[gap], E[gap²]

    def _outcome(self, tenant: str, came_back: bool) -> None:
        window = self._returns.get(tenant)
        if window is None:
            window = self._returns[tenant] = deque(maxlen=self.RETURN_WINDOW)
        window.append(came_back)

    def lease_lapsed(self, tenant: str) -> None:
        """A lease of `tenant` ended before its session came back."""
        self._outcome(tenant, False)

    def comes_back(self, tenant: str) -> bool:
        """False once none of the tenant's last `RETURN_WINDOW` leases saw a return."""
        window = self._returns.get(tenant)
        return window is None or len(window) < self.RETURN_WINDOW or any(window)

    def turn_ended(self, key: tuple[str, str], now: float) -> None:
        ended = self._ended
        ended.pop(key, None)
        ended[key] = now  # newest last: the dict is the LRU order
        if len(ended) > self.MAX_SESSIONS:
            oldest = next(iter(ended))
            del ended[oldest]
            self._session_mean.pop(oldest, None)

    def turn_started(self, key: tuple[str, str], now: float) -> None:
        """A session sent a request: the gap since its last turn is a pause."""
        ended = self._ended.pop(key, None)
        if ended is None:
            return
        gap = max(0.0, now - ended)
        tenant = key[0]
        self._outcome(tenant, True)
        seen = self._session_mean.get(key)
        self._session_mean[key] = (gap, 1.0) if seen is None else (
            self._mix(seen[0], gap), seen[1] * (1 - self.WEIGHT) ** 2 + self.WEIGHT ** 2)
        self._tenant_mean[tenant] = self._mix(self._tenant_mean.get(tenant), gap)
        n, mean, square = self._spread.get(tenant, (0, gap, gap * gap))
        w = max(self.SPREAD_WEIGHT, 1.0 / (n + 1))
        self._spread[tenant] = (n + 1, mean + w * (gap - mean), square + w * (gap * gap - square))

    def _mix(self, mean: float | None, gap: float) -> float:
        return gap if mean is None else mean + self.WEIGHT * (gap - mean)

    def typical_pause(self, tenant: str) -> float | None:
        """The mean pause of `tenant`'s sessions, None before one was seen."""
        return self._tenant_mean.get(tenant)

    def regular(self, tenant: str) -> bool:
        """Do the tenant's pauses keep a rhythm (coefficient of variation at most
        `REGULAR_CV`, over at least `REGULAR_SAMPLES` of them)? Exponential think times
        have a CV of 1; people reading answers of similar length, far less."""
        n, mean, square = self._spread.get(tenant, (0, 0.0, 0.0))
        if n < self.REGULAR_SAMPLES or mean <= 0:
            return False
        return max(0.0, square - mean * mean) <= (self.REGULAR_CV * mean) ** 2

    def return_pause(self, key: tuple[str, str]) -> float | None:
        """The pause after which the session should be back, when its tenant's pauses
        are regular enough to say (`regular`): its own mean, else its tenant's."""
        if not self.regular(key[0]):
            return None
        own = self.session_pause(key)
        return own if own is not None else self._tenant_mean.get(key[0])

    def session_pause(self, key: tuple[str, str]) -> float | None:
        """The session's own typical pause, None before it showed one."""
        seen = self._session_mean.get(key)
        return seen[0] if seen is not None else None

    def hold_seconds(self, key: tuple[str, str]) -> float:
        """How long the lease of `key` should last after the session's last activity,
        before the tenant's `lease.seconds` caps it (inf: no pause of its own yet, and
        the tenant's sessions do come back)."""
        seen = self._session_mean.get(key)
        if seen is None:
            return math.inf if self.comes_back(key[0]) else self.MIN_HOLD_S
        typical, weights_squared = seen
        return max(self.MIN_HOLD_S, self.pause_factor(1.0 / weights_squared) * typical)

    @classmethod
    def pause_factor(cls, pauses_seen: float) -> float:
        """c(n) = n (e^(PAUSE_FACTOR / n) - 1): how many typical pauses to hold when the
        typical pause rests on `pauses_seen` of them (see the class docstring)."""
        return pauses_seen * math.expm1(cls.PAUSE_FACTOR / pauses_seen)
