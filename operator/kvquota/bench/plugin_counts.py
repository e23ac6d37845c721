"""Counters the bench reads from the plugin's stats, in one place for both backends.

Preemptions of requests that outgrew their reserved output estimate (issue #29): a
tier that reserves `Estimated` admits a request for its prompt plus a learned output
estimate; one that decodes past it grows into its tenant's headroom, then free
blocks, and when both are gone the plugin's victim order may preempt it. The plugin
counts those per tenant; until a plugin publishes the counter, every tier reads 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine_sidecar.stats import EngineStats, TenantEngineStats

# The stats field the plugin counts them in (TenantEngineStats, by its Python name).
OUTGROWN_FIELD = "outgrown_preemptions"


def outgrown_preemptions(tenant_stats: TenantEngineStats) -> int:
    """0 when the plugin does not publish the counter (an older plugin)."""
    value = getattr(tenant_stats, OUTGROWN_FIELD, 0)
    return int(value) if isinstance(value, int) else 0


def outgrown_by_tier(stats: EngineStats, tier_of: Mapping[str, str]) -> dict[str, int]:
    """Per tier, over the tenants `tier_of` maps (unclassified traffic has no tier)."""
    by_tier: dict[str, int] = {}
    for tenant_id, tenant_stats in stats.tenants.items():
        tier = tier_of.get(tenant_id)
        if tier is not None:
            by_tier[tier] = by_tier.get(tier, 0) + outgrown_preemptions(tenant_stats)
    return by_tier
