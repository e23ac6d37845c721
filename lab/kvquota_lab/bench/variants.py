"""Victim-order variants: ablations of the plugin's documented order, twin only.

The plugin documents one total order (`engine_sidecar.plugin.rules.ranking`): expired leases;
then band (unclassified, borrowers, within guarantee); then tier; then, within a band
and tier, live leases before running requests, and the running request that loses
the least work. Each variant below changes one of those rules, so the benchmark shows
what each rule buys:

- `documented`: the plugin as shipped;
- `tier-first`: tier before band (a premium borrower outranks a free tenant within
  its guarantee);
- `running-before-leases`: within a band and tier, preempt running requests before
  releasing idle sessions' leases;
- `newest-first`: within a band and tier, preempt the newest running request (vLLM's
  own priority-policy order) instead of the one with the least computed work.

The plugin exposes no switch for its order; a variant builds one plugin instance with
its ranker (`PluginConfig.ranker`). This is a benchmark instrument, not a product
setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine_sidecar.contract.reclaim import Band
from engine_sidecar.plugin.rules.leases import Lease
from engine_sidecar.plugin.rules.ranking import RankKey, VictimRanker
from kvquota_lab.bench.policies import POLICIES, PolicySpec


class TierFirstRanker(VictimRanker):
    def running_key(
        self, tenant: str | None, priority: int, num_computed_tokens: int, arrival_time: float,
        above_max: bool = False,
    ) -> RankKey:
        tenant_policy = self.tenant_policy(tenant)
        if tenant_policy is None:
            return (1, priority, Band.UNCLASSIFIED, 0, 0, arrival_time)
        return (0, tenant_policy.priority, self.band(tenant_policy), 0,
                -num_computed_tokens, arrival_time)

    def lease_key(self, lease: Lease[Any]) -> RankKey:
        tenant_policy = self.tenant_policy(lease.tenant)
        if tenant_policy is None:
            return (1, math.inf, Band.UNCLASSIFIED, 1, -lease.last_activity)
        return (0, tenant_policy.priority, self.band(tenant_policy), 1, -lease.last_activity)

    @staticmethod
    def running_reason(key: RankKey) -> Any:
        return VictimRanker.running_reason((key[2],))


class RunningBeforeLeasesRanker(VictimRanker):
    def running_key(
        self, tenant: str | None, priority: int, num_computed_tokens: int, arrival_time: float,
        above_max: bool = False,
    ) -> RankKey:
        key = super().running_key(tenant, priority, num_computed_tokens, arrival_time,
                                  above_max)
        return (*key[:2], 1, *key[3:])

    def lease_key(self, lease: Lease[Any]) -> RankKey:
        key = super().lease_key(lease)
        return (*key[:2], 0, *key[3:])


class NewestFirstRanker(VictimRanker):
    def running_key(
        self, tenant: str | None, priority: int, num_computed_tokens: int, arrival_time: float,
        above_max: bool = False,
    ) -> RankKey:
        key = super().running_key(tenant, priority, num_computed_tokens, arrival_time,
                                  above_max)
        return (*key[:3], arrival_time, key[3])


@dataclass(frozen=True)
class VictimOrder:
    name: str
    description: str
    ranker: type[VictimRanker]


VICTIM_ORDERS: dict[str, VictimOrder] = {
    order.name: order
    for order in (
        VictimOrder("documented", "the plugin's documented order", VictimRanker),
        VictimOrder("tier-first", "tier before band", TierFirstRanker),
        VictimOrder("running-before-leases", "running requests before idle leases",
                    RunningBeforeLeasesRanker),
        VictimOrder("newest-first", "newest running request first (vLLM's order)",
                    NewestFirstRanker),
    )
}


def victim_order_specs(names: tuple[str, ...], bases: tuple[str, ...] = ("kvquota",)
                       ) -> list[PolicySpec]:
    """Policy runs for `names` ('all': every variant) on each KVQuota policy in `bases`."""
    # 'all' leaves out `documented`: the base run already is the documented order.
    wanted = [n for n in VICTIM_ORDERS if n != "documented"] if "all" in names else list(names)
    unknown = [n for n in wanted if n not in VICTIM_ORDERS]
    if unknown:
        raise ValueError(f"unknown victim orders {unknown}; choose from "
                         f"{', '.join(VICTIM_ORDERS)} or all")
    specs = []
    for base in bases:
        spec = POLICIES[base]
        for name in wanted:
            specs.append(PolicySpec(
                f"{base}:{name}", f"{spec.label} [{name}]", spec.scheduler, spec.admission,
                spec.tier_priority, variant=name,
            ))
    return specs


def victim_ranker(name: str) -> type[VictimRanker]:
    """The ranker the plugin runs the variant `name` with."""
    return VICTIM_ORDERS[name].ranker
