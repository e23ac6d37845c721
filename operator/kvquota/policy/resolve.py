"""A tenant's effective settings: tier defaults, then the pool's tier overrides, then
the TenantQuota's own overrides; finally the pool-wide quotas split per replica.

Precedence (most specific wins): `TenantQuota.spec.limits` / `spec.kvCache.lease`
> `InferencePool.spec.tiers.<tier>` > `TIER_DEFAULTS`. `defaultMaxTokens` is clamped
to the effective `maxTokens`, because an override of the ceiling alone must not leave
a default above it (the engine would refuse the policy).
"""

from __future__ import annotations

from engine_sidecar.contract.policy import (
    DEFAULT_ABOVE_MAX,
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


def tier_settings(pool: InferencePoolSpec, tier: Tier) -> TierDefaults:
    """The tier's built-in defaults with the pool's overrides applied."""
    defaults = TIER_DEFAULTS[tier]
    override = getattr(pool.tiers, tier.value)
    merged = defaults._replace(**{
        name: value for name in TierDefaults._fields
        if (value := getattr(override, name, None)) is not None
    })
    return merged._replace(default_max_tokens=min(merged.default_max_tokens, merged.max_tokens))


def effective_settings(
    pool: InferencePoolSpec,
    spec: TenantQuotaSpec,
    *,
    tenant_id: str,
    replicas: int,
    guaranteed_blocks: int | None = None,
) -> EffectiveSettings:
    """Resolve one tenant. `guaranteed_blocks` is what admission granted (0 for a quota
    that is not accepted); by default the requested guarantee."""
    tier = tier_settings(pool, spec.tier)
    granted = spec.kv_cache.guaranteed_blocks if guaranteed_blocks is None else guaranteed_blocks
    split = split_quota(granted, spec.kv_cache.max_blocks, replicas)
    max_tokens = spec.limits.max_tokens or tier.max_tokens
    default_max_tokens = min(spec.limits.default_max_tokens or tier.default_max_tokens, max_tokens)
    lease = spec.kv_cache.lease
    return EffectiveSettings(
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
        lease_max_blocks=lease.max_blocks or 0,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
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


def tenant_policy(effective: EffectiveSettings, *, pool_wide: bool = False) -> TenantPolicy:
    """The per-engine entry for the EnginePolicy (pool-wide caps split per replica);
    `pool_wide`: the pool has a shared store, so the entry carries the pool-wide quota."""
    replicas = effective.replicas or 1
    assert effective.tenant_id is not None and effective.tier is not None
    assert effective.priority is not None and effective.max_tokens is not None
    assert effective.default_max_tokens is not None
    return TenantPolicy(
        tenant_id=effective.tenant_id,
        tier=effective.tier,
        priority=effective.priority,
        guaranteed_blocks=effective.guaranteed_blocks_per_engine or 0,
        max_blocks=effective.max_blocks_per_engine or 0,
        lease=LeasePolicy(
            seconds=effective.lease_seconds or 0,
            max_sessions=split_ceiling(effective.lease_max_sessions, replicas) or 0,
            max_blocks=split_ceiling(effective.lease_max_blocks, replicas) or 0,
        ),
        max_tokens=effective.max_tokens,
        default_max_tokens=effective.default_max_tokens,
        max_prompt_tokens=effective.max_prompt_tokens,
        max_concurrent_requests=split_ceiling(effective.max_concurrent_requests, replicas),
        max_queue_seconds=effective.max_queue_seconds or 0,
        max_queued_requests=split_ceiling(effective.max_queued_requests, replicas) or 0,
        prefix_cache_isolation=effective.prefix_cache_isolation or "Tenant",
        above_max=effective.above_max or DEFAULT_ABOVE_MAX,
        pool_wide=PoolLimits(
            guaranteed_blocks=effective.guaranteed_blocks or 0,
            max_blocks=effective.max_blocks or 0,
            max_concurrent_requests=effective.max_concurrent_requests or None,
        ) if pool_wide else None,
    )
