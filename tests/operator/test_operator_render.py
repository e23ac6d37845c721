"""EnginePolicy and ConfigMap rendering (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_objects import pool
from pydantic import ValidationError

from engine_sidecar.contract.names import POLICY_FILE
from engine_sidecar.contract.policy import EnginePolicy, ReservationMode, TenantPolicy, Tier
from kvquota.api import InferencePoolSpec
from kvquota.policy.render import render_policy
from kvquota.reconcile.configmap import HASH_ANNOTATION, build_configmap, configmap_name


def _tenant(tenant_id: str, guaranteed: int = 10) -> TenantPolicy:
    return TenantPolicy(tenant_id=tenant_id, tier=Tier.FREE, priority=2,
                        guaranteed_blocks=guaranteed, max_blocks_per_engine=50,
                        max_tokens=512, default_max_tokens=256)


def _spec(**spec: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate(pool(**spec)["spec"])


def test_policy_carries_pool_settings_auth_and_a_content_hash() -> None:
    spec = _spec(auth={"jwt": {"secretRef": {"name": "auth", "key": "jwt.pub"},
                               "issuer": "https://issuer/"},
                       "anonymous": {"allowed": True, "tenantId": "guest"}})
    policy = render_policy("default", "demo-pool", spec, [_tenant("b"), _tenant("a")],
                           replicas=2)
    assert policy.pool == "default/demo-pool"
    assert policy.replicas == 2
    assert list(policy.tenants) == ["a", "b"]  # stable order, stable JSON
    assert policy.auth.jwt is not None and policy.auth.jwt.key_file == "jwt.pub"
    assert policy.auth.anonymous.tenant_id == "guest"
    assert policy.version == policy.content_hash()


def test_same_inputs_same_hash_any_change_new_hash() -> None:
    spec = _spec()
    first = render_policy("default", "p", spec, [_tenant("a"), _tenant("b")], replicas=1)
    again = render_policy("default", "p", spec, [_tenant("b"), _tenant("a")], replicas=1)
    changed = render_policy("default", "p", spec, [_tenant("a", 11), _tenant("b")], replicas=1)
    assert first.version == again.version
    assert changed.version != first.version


def test_configmap_is_owned_by_the_pool_and_holds_a_loadable_policy() -> None:
    policy = render_policy("team-a", "demo-pool", _spec(), [_tenant("a")], replicas=1)
    cm = build_configmap("team-a", "demo-pool", "uid-1", policy)
    assert cm["metadata"]["name"] == "demo-pool-kvquota-policy"
    assert cm["metadata"]["namespace"] == "team-a"
    assert cm["metadata"]["annotations"][HASH_ANNOTATION] == policy.version
    (owner,) = cm["metadata"]["ownerReferences"]
    assert owner == {"apiVersion": "kvquota.dev/v1alpha1", "kind": "InferencePool",
                     "name": "demo-pool", "uid": "uid-1", "controller": True}
    loaded = EnginePolicy.from_json(cm["data"][POLICY_FILE])  # the engine's own check
    assert loaded.version == policy.version
    assert json.loads(cm["data"][POLICY_FILE])["tenants"]["a"]["guaranteedBlocks"] == 10


def test_long_pool_names_still_give_a_valid_unique_configmap_name() -> None:
    long_a, long_b = "a" * 250, "a" * 249 + "b"
    assert len(configmap_name(long_a)) <= 253
    assert configmap_name(long_a) != configmap_name(long_b)


def test_max_token_lifetime_reaches_the_sidecar_policy() -> None:
    jwt = {"secretRef": {"name": "auth", "key": "jwt.pub"}}
    capped = render_policy("default", "p", _spec(auth={"jwt": {
        **jwt, "maxTokenLifetimeSeconds": 3600}}), [_tenant("a")], replicas=1)
    uncapped = render_policy("default", "p", _spec(auth={"jwt": jwt}), [_tenant("a")],
                             replicas=1)
    assert capped.auth.jwt is not None and capped.auth.jwt.max_token_lifetime_seconds == 3600
    assert uncapped.auth.jwt is not None and uncapped.auth.jwt.max_token_lifetime_seconds is None
    loaded = EnginePolicy.from_json(capped.to_json())
    assert loaded.auth.jwt is not None and loaded.auth.jwt.max_token_lifetime_seconds == 3600


def test_a_policy_joined_from_tenant_pieces_is_the_policy_serialised_whole() -> None:
    """The operator keeps each tenant's JSON between plans and joins the pieces; the
    version must be the one engines recompute (they refuse a mismatch), and the
    ConfigMap text what the whole policy's to_json() writes."""
    from kvquota.policy.render import compose_policy, render_tenant

    spec = _spec(auth={"anonymous": {"allowed": True, "tenantId": "guest"}})
    tenants = [_tenant(f"t-{i}.x_{i % 3}", guaranteed=i) for i in (12, 3, 7)]
    for chosen in ([], tenants[:1], tenants):
        rendered = compose_policy("team-a", "p", spec, map(render_tenant, chosen), replicas=3)
        assert list(rendered.policy.tenants) == sorted(t.tenant_id for t in chosen)
        assert rendered.policy.version == rendered.policy.content_hash()
        assert rendered.text == rendered.policy.to_json()
        assert EnginePolicy.from_json(rendered.text) == rendered.policy
        cm = build_configmap("team-a", "p", "uid-1", rendered)
        assert cm == build_configmap("team-a", "p", "uid-1", rendered.policy)


def test_a_tiers_reservation_reaches_the_engines_and_unset_tiers_reserve_estimated() -> None:
    spec = _spec(tiers={"premium": {"reservation": "Full"}})
    policy = render_policy("default", "p", spec, [_tenant("a")], replicas=1)
    assert policy.reservation_for(Tier.PREMIUM) is ReservationMode.FULL
    assert policy.reservation_for(Tier.FREE) is ReservationMode.ESTIMATED
    assert EnginePolicy.from_json(policy.to_json()).reservation_for(Tier.PREMIUM) is (
        ReservationMode.FULL)


def test_a_pool_that_sets_no_reservation_renders_the_policy_it_did_before() -> None:
    policy = render_policy("default", "p", _spec(), [_tenant("a")], replicas=1)
    assert "reservation" not in json.loads(policy.to_json())


def test_an_unknown_reservation_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValidationError, match="'Estimated' or 'Full'"):
        _spec(tiers={"free": {"reservation": "MaxTokens"}})
