"""Counters the bench reads from the plugin's stats, in one place for both backends.

Preemptions of requests that outgrew their reserved output estimate: a
tier that reserves `Estimated` admits a request for its prompt plus a learned output
estimate; one that decodes past it grows into its tenant's headroom, then free
blocks, and when both are gone the plugin's victim order may preempt it. The plugin
counts those per tenant (`TenantEngineStats.outgrown_preemptions`, within its
`preemptions`); a stats file from a plugin without the counter reads 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine_sidecar.contract.stats import EngineStats, TenantEngineStats

ABOVE_MAX = "above_max"  # the plugin's preemption reason (`ranking.Reason`)


def outgrown_by_tier(stats: EngineStats, tier_of: Mapping[str, str]) -> dict[str, int]:
    """Per tier, over the tenants `tier_of` maps (unclassified traffic has no tier)."""
    return _by_tier(stats, tier_of, lambda t: t.outgrown_preemptions)


def above_max_by_tier(stats: EngineStats, tier_of: Mapping[str, str]) -> dict[str, int]:
    """Preemptions of work run beyond its tenant's maxBlocks (aboveMax: Reclaimable),
    reclaimed for another tenant or given back to its own growth, per tier."""
    return _by_tier(stats, tier_of, lambda t: t.preemptions.get(ABOVE_MAX, 0))


def _by_tier(stats: EngineStats, tier_of: Mapping[str, str],
             count: Callable[[TenantEngineStats], int]) -> dict[str, int]:
    by_tier: dict[str, int] = {}
    for tenant_id, tenant_stats in stats.tenants.items():
        tier = tier_of.get(tenant_id)
        if tier is not None:
            by_tier[tier] = by_tier.get(tier, 0) + count(tenant_stats)
    return by_tier
