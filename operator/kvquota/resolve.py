"""A tenant's effective settings: tier defaults, then the pool's tier overrides, then
the TenantQuota's own overrides; finally the pool-wide quotas split per replica.

Precedence (most specific wins): `TenantQuota.spec.limits` / `spec.kvCache.lease`
> `InferencePool.spec.tiers.<tier>` > `TIER_DEFAULTS`. `defaultMaxTokens` is clamped
to the effective `maxTokens`, because an override of the ceiling alone must not leave
a default above it (the engine would refuse the policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_sidecar.policy import LeasePolicy, TenantPolicy, Tier
from kvquota.api import TIER_DEFAULTS, EffectiveSettings, InferencePoolSpec, TenantQuotaSpec
from kvquota.capacity import split_ceiling, split_quota


@dataclass(frozen=True)
class TierSettings:
    priority: int
    lease_seconds: int
    max_tokens: int
    default_max_tokens: int


def tier_settings(pool: InferencePoolSpec, tier: Tier) -> TierSettings:
    priority, lease_seconds, max_tokens, default_max_tokens = TIER_DEFAULTS[tier]
    override = getattr(pool.tiers, tier.value)
    ceiling = override.max_tokens if override.max_tokens is not None else max_tokens
    default = (
        override.default_max_tokens if override.default_max_tokens is not None
        else default_max_tokens
    )
    return TierSettings(
        priority=override.priority if override.priority is not None else priority,
        lease_seconds=(
            override.lease_seconds if override.lease_seconds is not None else lease_seconds
        ),
        max_tokens=ceiling,
        default_max_tokens=min(default, ceiling),
    )


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
        prefix_cache_isolation=spec.prefix_cache.isolation,
    )


def tenant_policy(effective: EffectiveSettings) -> TenantPolicy:
    """The per-engine entry for the EnginePolicy (pool-wide caps split per replica)."""
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
        prefix_cache_isolation=effective.prefix_cache_isolation or "Tenant",
    )
