"""EnginePolicy: the contract the operator renders and engines apply."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy, Tier


def _tenant(tenant_id: str = "acme", **overrides: object) -> TenantPolicy:
    fields: dict[str, object] = {
        "tenant_id": tenant_id, "tier": Tier.PREMIUM, "priority": 0,
        "guaranteed_blocks": 10, "max_blocks_per_engine": 20, "max_tokens": 256,
        "default_max_tokens": 64, **overrides,
    }
    return TenantPolicy.model_validate(fields)


def _policy(**tenants: TenantPolicy) -> EnginePolicy:
    return EnginePolicy(pool="default/demo", model="tiny", tenants=tenants).with_version()


def test_round_trip_keeps_content_and_version() -> None:
    policy = _policy(acme=_tenant())
    parsed = EnginePolicy.from_json(policy.to_json())
    assert parsed == policy
    assert '"guaranteedBlocks": 10' in policy.to_json()  # camelCase on the wire


def test_version_changes_with_content_only() -> None:
    a, b = _policy(acme=_tenant()), _policy(acme=_tenant())
    assert a.version == b.version and a.version.startswith("sha256:")
    assert _policy(acme=_tenant(max_blocks_per_engine=21)).version != a.version


def test_tampered_policy_is_refused() -> None:
    raw = _policy(acme=_tenant()).to_json().replace('"maxBlocks": 20', '"maxBlocks": 2000')
    with pytest.raises(ValueError, match="does not match its content"):
        EnginePolicy.from_json(raw)


def test_invalid_tenant_says_which_and_why() -> None:
    with pytest.raises(ValidationError, match=r"tenant acme: maxBlocks \(5\) must be >= "):
        _tenant(max_blocks_per_engine=5)
    with pytest.raises(ValidationError, match="holds tenantId 'acme'"):
        EnginePolicy(pool="p", model="m", tenants={"other": _tenant()})
