"""Effective settings: tier defaults, pool overrides, tenant overrides, the split."""

from __future__ import annotations

from typing import Any

from operator_objects import pool, quota

from engine_sidecar.contract.policy import Isolation, Tier
from kvquota.api import InferencePoolSpec, TenantQuotaSpec
from kvquota.policy.resolve import resolve_tenant, tenant_policy, tier_settings


def _pool_spec(**spec: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate(pool(**spec)["spec"])


def _quota_spec(**kw: Any) -> TenantQuotaSpec:
    return TenantQuotaSpec.model_validate(quota("t", **kw)["spec"])


def test_tier_defaults_apply_without_overrides() -> None:
    premium = tier_settings(_pool_spec(), Tier.PREMIUM)
    assert (premium.priority, premium.lease_seconds, premium.max_tokens) == (0, 300, 4096)
    assert tier_settings(_pool_spec(), Tier.FREE).lease_seconds == 0


def test_pool_overrides_one_field_and_default_is_clamped_to_the_new_ceiling() -> None:
    spec = _pool_spec(tiers={"premium": {"maxTokens": 512}})
    premium = tier_settings(spec, Tier.PREMIUM)
    assert premium.max_tokens == 512
    assert premium.default_max_tokens == 512  # tier default 1024 would exceed the ceiling
    assert premium.lease_seconds == 300


def test_tenant_overrides_win_over_the_tier() -> None:
    spec = _pool_spec(tiers={"standard": {"leaseSeconds": 90}})
    tq = _quota_spec(
        tier="standard", guaranteed=40, maximum=90,
        kvCache={"lease": {"seconds": 15, "maxSessions": 3}},
        limits={"maxTokens": 300, "maxConcurrentRequests": 5},
        prefixCache={"isolation": "Shared"},
    )
    eff = resolve_tenant(spec, tq, tenant_id="t", replicas=1)
    assert eff.lease_seconds == 15
    assert eff.max_tokens == 300
    assert eff.default_max_tokens == 300  # tier default 512 clamped to the tenant ceiling
    assert eff.priority == 1
    assert eff.prefix_cache_isolation == Isolation.SHARED


def test_pool_wide_budgets_are_split_across_ready_replicas() -> None:
    tq = _quota_spec(tier="premium", guaranteed=100, maximum=250,
                     kvCache={"lease": {"maxBlocks": 31}}, limits={"maxConcurrentRequests": 7})
    eff = resolve_tenant(_pool_spec(), tq, tenant_id="t", replicas=3)
    assert (eff.guaranteed_blocks, eff.max_blocks, eff.replicas) == (100, 250, 3)
    assert (eff.guaranteed_blocks_per_engine, eff.max_blocks_per_engine) == (33, 84)
    entry = tenant_policy(eff)
    assert (entry.guaranteed_blocks, entry.max_blocks_per_engine) == (33, 84)
    assert entry.lease.max_leased_blocks == 11  # ceil(31 / 3)
    assert entry.max_concurrent_requests == 3


def test_refused_quota_keeps_its_ceiling_but_no_guarantee() -> None:
    tq = _quota_spec(guaranteed=100, maximum=200)
    eff = resolve_tenant(_pool_spec(), tq, tenant_id="t", replicas=2, guaranteed_blocks=0)
    assert (eff.guaranteed_blocks_per_engine, eff.max_blocks_per_engine) == (0, 100)
