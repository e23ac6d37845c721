"""What the engines reported, summed per pool and per tenant, and the disruption window.

The operator polls each ready engine's sidecar (`SidecarStatus`); these pure helpers
turn the reports into status figures. Counters are cumulative per engine process, so
"in the last window" is computed from deltas between polls, and an engine restart
(a counter going down) counts its new value as the delta.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from engine_sidecar.contract.stats import SidecarStatus, TenantCounters, TenantStatus, TenantUsage


@dataclass(frozen=True)
class EngineObservation:
    """One poll of a pool's engines. `matched` counts the pods the selector matched,
    `ready` lists the ready ones; `reports` holds the sidecar status of those that
    answered, `errors` why the others did not (or why their policy was refused)."""

    matched: int = 0
    ready: tuple[str, ...] = ()
    reports: Mapping[str, SidecarStatus] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)
    observed_at: float = 0.0

    @property
    def replicas(self) -> int:
        return len(self.ready)

    def reported_capacities(self) -> list[int]:
        return [r.total_blocks for r in self.reports.values() if r.ready and r.total_blocks > 0]


@dataclass(frozen=True)
class PoolUsage:
    used_blocks: int = 0
    leased_blocks: int = 0
    tenants: Mapping[str, TenantStatus] = field(default_factory=dict)


# Usage figures that are a longest time or a per-request size, not a count: the pool's
# is the largest engine's.
_LONGEST = frozenset({"queue_wait_seconds", "output_estimate_tokens"})


def _sum_tenant(parts: Iterable[TenantStatus]) -> TenantStatus:
    usage: dict[str, float] = dict.fromkeys(TenantUsage.model_fields, 0)
    counters: dict[str, int] = dict.fromkeys(TenantCounters.model_fields, 0)
    for part in parts:
        for name in usage:
            value = getattr(part.usage, name)
            usage[name] = max(usage[name], value) if name in _LONGEST else usage[name] + value
        for name in counters:
            counters[name] += getattr(part.counters, name)
    return TenantStatus(usage=TenantUsage(**usage), counters=TenantCounters(**counters))


def aggregate(reports: Iterable[SidecarStatus]) -> PoolUsage:
    """Pool-wide sums over the engines that answered."""
    reports = list(reports)
    per_tenant: dict[str, list[TenantStatus]] = {}
    for report in reports:
        for tenant_id, status in report.tenants.items():
            per_tenant.setdefault(tenant_id, []).append(status)
    tenants = {tenant_id: _sum_tenant(parts) for tenant_id, parts in per_tenant.items()}
    return PoolUsage(
        used_blocks=sum(max(r.total_blocks - r.free_blocks, 0) for r in reports),
        leased_blocks=sum(t.usage.leased_blocks for t in tenants.values()),
        tenants=tenants,
    )


@dataclass(frozen=True)
class Disruptions:
    """Disruptions of one tenant inside the window. `complete` says the window is fully
    covered by observations, so zero counts mean "none" rather than "not seen yet"."""

    lease_breaks: int
    preemptions: int
    degraded_events: int
    complete: bool


_Counts = tuple[int, int, int]  # lease breaks, preemptions, degraded events


def _counts(status: TenantStatus) -> _Counts:
    c = status.counters
    return (c.lease_breaks, c.preemptions, c.degraded_events)


class DisruptionWindow:
    """Per-tenant disruption counts over the last `window` seconds of polls."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._first_seen: float | None = None
        self._last: dict[str, dict[str, _Counts]] = {}  # engine -> tenant -> counts
        self._deltas: deque[tuple[float, str, _Counts]] = deque()

    def observe(self, now: float, reports: Mapping[str, SidecarStatus]) -> None:
        if self._first_seen is None:
            self._first_seen = now
        for engine, report in reports.items():
            before = self._last.get(engine)
            current = {tenant: _counts(s) for tenant, s in report.tenants.items()}
            if before is not None:  # a new engine only sets a baseline
                for tenant, counts in current.items():
                    old = before.get(tenant, (0, 0, 0))
                    delta = tuple(
                        new - prev if new >= prev else new
                        for new, prev in zip(counts, old, strict=True)
                    )
                    if any(delta):
                        self._deltas.append((now, tenant, (delta[0], delta[1], delta[2])))
            self._last[engine] = current
        for gone in set(self._last) - set(reports):
            del self._last[gone]
        while self._deltas and self._deltas[0][0] < now - self.window:
            self._deltas.popleft()

    def disruptions(self, tenant_id: str, now: float) -> Disruptions | None:
        """None before the first observation (nothing is known yet)."""
        if self._first_seen is None:
            return None
        totals = [0, 0, 0]
        for when, tenant, delta in self._deltas:
            if tenant == tenant_id and when >= now - self.window:
                for i in range(3):
                    totals[i] += delta[i]
        return Disruptions(
            lease_breaks=totals[0],
            preemptions=totals[1],
            degraded_events=totals[2],
            complete=now - self._first_seen >= self.window,
        )
