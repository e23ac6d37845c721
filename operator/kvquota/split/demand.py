"""The operator's demand-driven split: one pool's state between poll rounds, and the
per-engine overrides it puts into the pool's policy.

Every poll round of a pool runs `rebalance.rebalance_pool` on what each ready engine's
sidecar reported (`demand_from_status`: usage now, admissions and refusals since that
engine's previous poll) from the split in force, so the split moves at most one bounded
step per poll interval (the function's hysteresis). The policy carries only what
differs from the even split (`EnginePolicy.engines`, keyed by pod name); a tenant whose
quota, admission or engine count changed since the split was computed falls back to the
even split until the next round recomputes it. Deterministic: the same reports give the
same split. State lives in memory only: after a restart the split starts from even.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine_sidecar.contract.policy import EnginePolicy, EngineShare, TenantPolicy
from engine_sidecar.contract.stats import SidecarStatus
from kvquota.split.rebalance import (
    EngineDemand,
    EngineSplit,
    RebalanceSettings,
    TenantTotals,
    demand_from_status,
    rebalance_pool,
)

Splits = Mapping[str, Mapping[str, EngineSplit]]  # tenant id -> engine pod -> split


@dataclass(frozen=True)
class SplitInputs:
    """What a poll round needs of the pool's latest plan."""

    tenants: Sequence[TenantTotals]  # pool-wide granted guarantee and ceiling, priority
    capacity_per_engine: int | None  # None: unknown, no rebalance
    watermark: float


@dataclass
class PoolSplit:
    """One pool's demand-driven split: the split in force and each engine's previous
    report (what "since the last poll" is counted from)."""

    settings: RebalanceSettings = field(default_factory=RebalanceSettings)
    splits: dict[str, dict[str, EngineSplit]] = field(default_factory=dict)
    rounds: int = 0
    _previous: dict[str, SidecarStatus] = field(default_factory=dict)

    def poll_round(self, inputs: SplitInputs, ready: Sequence[str],
                   reports: Mapping[str, SidecarStatus]) -> None:
        """Move the split one round toward where the demand is. A ready engine that did
        not answer counts as having no demand; with fewer than two engines or an
        unknown capacity there is nothing to move (the even split)."""
        engines = sorted(ready)
        previous = self._previous
        # An engine that did not answer keeps its last report: its next answer's
        # counters count from there, not from its start.
        self._previous = {**{pod: r for pod, r in previous.items() if pod in engines},
                          **reports}
        if len(engines) < 2 or not inputs.capacity_per_engine:
            self.splits = {}
            return
        demand: dict[str, dict[str, EngineDemand]] = {}
        for pod in engines:
            report = reports.get(pod)
            if report is None:
                continue
            for tenant_id, seen in demand_from_status(report, previous.get(pod)).items():
                demand.setdefault(tenant_id, {})[pod] = seen
        guaranteeable = math.floor(inputs.capacity_per_engine * (1.0 - inputs.watermark))
        self.splits = rebalance_pool(
            inputs.tenants, demand, self.splits, engines=engines,
            guaranteeable_per_engine=guaranteeable, settings=self.settings,
        )
        self.rounds += 1


def engine_overrides(
    tenants: Mapping[str, TenantPolicy], splits: Splits, replicas: int,
) -> dict[str, dict[str, EngineShare]]:
    """The policy's `engines` map: for each tenant whose split is one of its current
    totals over `replicas` engines (the even entry in `tenants` times `replicas`, the
    same headroom everywhere), the engines where it differs from the even entry.

    An engine's ceiling is its split's (guarantee plus the even headroom) where the
    split raised it, and never below the even entry's. The split is read from the last
    poll: a ceiling lowered on it refuses a session that comes back to its engine with
    a context grown since then, while the tenant is within its pool-wide guarantee
    (the engines it left hold little). Below the even ceiling and above a lowered
    guarantee the tenant borrows, as under the even split above the even guarantee:
    admitted only into free blocks above the watermark and the first taken back. The
    guarantees still add up to the pool-wide one; the pool-wide ceiling holds to within
    the guarantee the split moved, which a tenant can pass only by filling every
    engine to its ceiling."""
    out: dict[str, dict[str, EngineShare]] = {}
    for tenant_id, even in tenants.items():
        split = splits.get(tenant_id)
        if not split or len(split) != replicas:
            continue
        headroom = even.max_blocks_per_engine - even.guaranteed_blocks
        if (sum(s.guaranteed for s in split.values()) != even.guaranteed_blocks * replicas
                or any(s.maximum - s.guaranteed != headroom for s in split.values())):
            continue  # computed for other totals: even until the next round
        for pod, share in split.items():
            maximum = max(share.maximum, even.max_blocks_per_engine)
            if (share.guaranteed, maximum) != (even.guaranteed_blocks,
                                               even.max_blocks_per_engine):
                out.setdefault(pod, {})[tenant_id] = EngineShare(
                    guaranteed_blocks=share.guaranteed, max_blocks_per_engine=maximum)
    return out


def tenant_engine_split(policy: EnginePolicy, tenant_id: str,
                        pods: Sequence[str]) -> list[tuple[str, int, int]]:
    """(pod, guaranteed, maximum) of the tenant on each of `pods`, sorted by pod, as
    `policy.for_engine(pod)` gives it (`EnginePolicy.blocks_on`)."""
    if tenant_id not in policy.tenants:
        return []
    return [(pod, *policy.blocks_on(pod, tenant_id)) for pod in sorted(pods)]


def moved_tenants_split(policy: EnginePolicy, pods: Sequence[str]
                        ) -> dict[tuple[str, str], tuple[int, int]]:
    """`(tenant id, pod) -> (guaranteed, maximum)` on every one of `pods`, for the
    tenants that have an override on some engine (what the metrics export)."""
    moved = sorted({tenant_id for shares in policy.engines.values() for tenant_id in shares})
    return {(tenant_id, pod): (guaranteed, maximum)
            for tenant_id in moved
            for pod, guaranteed, maximum in tenant_engine_split(policy, tenant_id, pods)}
