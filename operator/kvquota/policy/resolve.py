"""A tenant's resolved settings: tier defaults, then the pool's tier overrides, then
the TenantQuota's own overrides; then the pool-wide quotas split per replica.

Precedence (most specific wins): `TenantQuota.spec.limits` / `spec.kvCache.lease`
> `InferencePool.spec.tiers.<tier>` > `TIER_DEFAULTS`. `defaultMaxTokens` is clamped
to the effective `maxTokens`, because an override of the ceiling alone must not leave
a default above it (the engine would refuse the policy). The EnginePolicy entry and
the status's `effective` are both rendered from one `ResolvedTenant`, whose every
field is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine_sidecar.contract.policy import (
    AboveMax,
    Isolation,
    LeasePolicy,
    PoolLimits,
    TenantPolicy,
    Tier,
)
from kvquota.api import (
    TIER_DEFAULTS,
    EffectiveSettings,
    InferencePoolSpec,
    TenantQuotaSpec,
    TierDefaults,
)
from kvquota.split.capacity import split_ceiling, split_quota


@dataclass(frozen=True)
class ResolvedTenant:
    """One tenant's settings with every default applied. Block, session and request
    caps are pool-wide (0 or None: no cap) unless named per engine."""

    tenant_id: str
    tier: Tier
    priority: int
    guaranteed_blocks: int  # granted: 0 while the quota is not accepted
    max_blocks: int
    replicas: int  # ready engines the quotas are split over, at least 1
    guaranteed_blocks_per_engine: int
    max_blocks_per_engine: int
    lease_seconds: int
    lease_max_sessions: int
    max_leased_blocks: int
    max_tokens: int
    default_max_tokens: int
    max_prompt_tokens: int | None
    max_concurrent_requests: int | None
    max_queue_seconds: int
    max_queued_requests: int
    prefix_cache_isolation: Isolation
    above_max: AboveMax


def tier_settings(pool: InferencePoolSpec, tier: Tier) -> TierDefaults:
    """The tier's built-in defaults with the pool's overrides applied."""
    defaults = TIER_DEFAULTS[tier]
    override = getattr(pool.tiers, tier.value)
    merged = defaults._replace(**{
        name: value for name in TierDefaults._fields
        if (value := getattr(override, name, None)) is not None
    })
    return merged._replace(default_max_tokens=min(merged.default_max_tokens, merged.max_tokens))


def resolve_tenant(
    pool: InferencePoolSpec,
    spec: TenantQuotaSpec,
    *,
    tenant_id: str,
    replicas: int,
    guaranteed_blocks: int | None = None,
) -> ResolvedTenant:
    """Resolve one tenant. `guaranteed_blocks` is what admission granted (0 for a quota
    that is not accepted); by default the requested guarantee."""
    tier = tier_settings(pool, spec.tier)
    granted = spec.kv_cache.guaranteed_blocks if guaranteed_blocks is None else guaranteed_blocks
    split = split_quota(granted, spec.kv_cache.max_blocks, replicas)
    max_tokens = spec.limits.max_tokens or tier.max_tokens
    lease = spec.kv_cache.lease
    return ResolvedTenant(
        tenant_id=tenant_id,
        tier=spec.tier,
        priority=tier.priority,
        guaranteed_blocks=granted,
        max_blocks=spec.kv_cache.max_blocks,
        replicas=max(replicas, 1),
        guaranteed_blocks_per_engine=split.guaranteed,
        max_blocks_per_engine=split.maximum,
        lease_seconds=lease.seconds if lease.seconds is not None else tier.lease_seconds,
        lease_max_sessions=lease.max_sessions or 0,
        max_leased_blocks=lease.max_leased_blocks or 0,
        max_tokens=max_tokens,
        default_max_tokens=min(spec.limits.default_max_tokens or tier.default_max_tokens,
                               max_tokens),
        max_prompt_tokens=spec.limits.max_prompt_tokens,
        max_concurrent_requests=spec.limits.max_concurrent_requests,
        max_queue_seconds=tier.max_queue_seconds,
        max_queued_requests=(
            spec.limits.max_queued_requests if spec.limits.max_queued_requests is not None
            else tier.max_queued_requests
        ),
        prefix_cache_isolation=spec.prefix_cache.isolation,
        above_max=spec.kv_cache.above_max,
    )


def effective_settings(resolved: ResolvedTenant) -> EffectiveSettings:
    """The status's view of the resolved settings (`TenantQuota.status.effective`)."""
    return EffectiveSettings(**dataclasses.asdict(resolved))


def tenant_policy(resolved: ResolvedTenant, *, pool_wide: bool = False) -> TenantPolicy:
    """The per-engine entry for the EnginePolicy (pool-wide caps split per replica);
    `pool_wide`: the pool has a shared store, so the entry carries the pool-wide quota."""
    replicas = resolved.replicas
    return TenantPolicy(
        tenant_id=resolved.tenant_id,
        tier=resolved.tier,
        priority=resolved.priority,
        guaranteed_blocks=resolved.guaranteed_blocks_per_engine,
        max_blocks_per_engine=resolved.max_blocks_per_engine,
        lease=LeasePolicy(
            seconds=resolved.lease_seconds,
            max_sessions=split_ceiling(resolved.lease_max_sessions, replicas) or 0,
            max_leased_blocks=split_ceiling(resolved.max_leased_blocks, replicas) or 0,
        ),
        max_tokens=resolved.max_tokens,
        default_max_tokens=resolved.default_max_tokens,
        max_prompt_tokens=resolved.max_prompt_tokens,
        max_concurrent_requests=split_ceiling(resolved.max_concurrent_requests, replicas),
        max_queue_seconds=resolved.max_queue_seconds,
        max_queued_requests=split_ceiling(resolved.max_queued_requests, replicas) or 0,
        prefix_cache_isolation=resolved.prefix_cache_isolation,
        above_max=resolved.above_max,
        pool_wide=PoolLimits(
            guaranteed_blocks=resolved.guaranteed_blocks,
            max_blocks=resolved.max_blocks,
            max_concurrent_requests=resolved.max_concurrent_requests or None,
        ) if pool_wide else None,
    )
