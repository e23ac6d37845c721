"""Samples validate against the generated CRDs; each planted-bad object fails its rule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvquota.api.validation import RULES_NOT_CHECKED, validate_object

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return doc


def _sample_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(SAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("apiVersion", "").startswith("kvquota.dev/"):
                docs.append((path.name, doc))
    return docs


def test_samples_are_one_pool_and_three_tiers() -> None:
    kinds = sorted((d["kind"], d["spec"].get("tier", "")) for _, d in _sample_docs())
    assert kinds == [
        ("InferencePool", ""),
        ("TenantQuota", "free"),
        ("TenantQuota", "premium"),
        ("TenantQuota", "standard"),
    ]


@pytest.mark.parametrize(("name", "doc"), _sample_docs(), ids=lambda v: str(v)[:40])
def test_sample_validates(name: str, doc: dict[str, Any]) -> None:
    assert validate_object(doc) == []


def _pool(**spec: Any) -> dict[str, Any]:
    doc = _load("inferencepool.yaml")
    doc["spec"].update(spec)
    return doc


def _tenant(**spec: Any) -> dict[str, Any]:
    doc = _load("tenantquota-premium.yaml")
    doc["spec"].update(spec)
    return doc


def _kv(**kv: Any) -> dict[str, Any]:
    return {"guaranteedBlocks": 10, "maxBlocks": 20, **kv}


PLANTED: list[tuple[str, dict[str, Any], str]] = [
    ("max below guaranteed", _tenant(kvCache=_kv(guaranteedBlocks=30)),
     "spec.kvCache: Invalid value: maxBlocks (20) must be >= guaranteedBlocks (30)"),
    ("watermark too high", _pool(kvCache={"watermark": 0.5}),
     "spec.kvCache.watermark: Invalid value: 0.5: kvCache.watermark must be >= 0 and < 0.5"),
    ("watermark negative", _pool(kvCache={"watermark": -0.1}),
     "spec.kvCache.watermark: Invalid value: -0.1: kvCache.watermark must be >= 0 and < 0.5"),
    ("unknown tier", _tenant(tier="gold"),
     'spec.tier: Unsupported value: "gold": supported values: "premium", "standard", "free"'),
    ("bad tenantId", _tenant(tenantId="Acme Corp"),
     'spec.tenantId: Invalid value: "Acme Corp": spec.tenantId in body should match'),
    ("both selector and gateway ref", _pool(gatewayPoolRef={"name": "gw-pool"}),
     "exactly one of selector or gatewayPoolRef must be set"),
    ("neither selector nor gateway ref", _pool(selector=None),
     "exactly one of selector or gatewayPoolRef must be set"),
    ("empty selector", _pool(selector={}),
     "selector must have matchLabels or matchExpressions"),
    ("model name too long", _pool(model="m" * 513),
     "spec.model: Too long: may not be more than 512 bytes"),
    ("too many algorithms", _pool(auth={"jwt": {
        "secretRef": {"name": "s", "key": "k"}, "algorithms": ["RS256"] * 9}}),
     "spec.auth.jwt.algorithms: Too many: 9: must have at most 8 items"),
    ("HS mixed with RS", _pool(auth={"jwt": {
        "secretRef": {"name": "s", "key": "k"}, "algorithms": ["HS256", "RS256"]}}),
     "jwt.algorithms must not mix HMAC (HS*) with public-key algorithms"),
    ("anonymous without tenant", _pool(auth={"anonymous": {"allowed": True}}),
     "anonymous.tenantId is required when allowed"),
    ("tier default above ceiling", _pool(tiers={"free": {"maxTokens": 10, "defaultMaxTokens": 20}}),
     "defaultMaxTokens must be <= maxTokens"),
    ("limits default above ceiling", _tenant(limits={"maxTokens": 10, "defaultMaxTokens": 20}),
     "limits.defaultMaxTokens must be <= limits.maxTokens"),
    ("negative guaranteed", _tenant(kvCache=_kv(guaranteedBlocks=-1)),
     "spec.kvCache.guaranteedBlocks in body should be greater than or equal to 0"),
    ("missing poolRef", _tenant(poolRef=None), "spec.poolRef: Required value"),
    ("unknown field", _tenant(quota=5), 'unknown field "spec.quota"'),
    ("wrong type", _tenant(kvCache=_kv(maxBlocks="lots")),
     'spec.kvCache.maxBlocks: Invalid value: "string": spec.kvCache.maxBlocks in body must '
     'be of type integer: "string"'),
    ("name not a subdomain", _tenant(tenantId="acme") | {"metadata": {"name": "Acme"}},
     'metadata.name: Invalid value: "Acme": a lowercase RFC 1123 subdomain must consist of'),
]


def _drop_nones(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
    return doc


@pytest.mark.parametrize(("case", "doc", "message"), PLANTED, ids=[c[0] for c in PLANTED])
def test_planted_bad_object_fails_with_its_rule(
    case: str, doc: dict[str, Any], message: str
) -> None:
    errors = validate_object(_drop_nones(copy.deepcopy(doc)))
    assert any(message in e for e in errors), errors
    own = [e for e in errors if e != RULES_NOT_CHECKED]
    assert len(own) == 1, f"{case}: expected only its own error, got {errors}"


def test_every_message_expression_is_shown_with_its_values() -> None:
    """Local mode evaluates each messageExpression (CEL's `format`) as the API server
    does, rather than falling back to the static message."""
    doc = _tenant(kvCache=_kv(guaranteedBlocks=30, maxBlocks=20, lease={"maxBlocks": 25}))
    assert validate_object(doc) == [
        "spec.kvCache: Invalid value: maxBlocks (20) must be >= guaranteedBlocks (30)",
        "spec.kvCache: Invalid value: lease.maxBlocks (25) must be <= maxBlocks (20)",
    ]


def test_schema_errors_that_block_the_rules_say_so_as_the_api_server_does() -> None:
    """A missing, unsupported, too long or mistyped value stops the CEL rules and the
    API server adds a line saying some were not checked; a pattern or bound error does
    not stop them, and both errors are reported."""
    blocked = _drop_nones(_tenant(tier="gold", kvCache=_kv(guaranteedBlocks=30)))
    errors = validate_object(blocked)
    assert errors[-1] == RULES_NOT_CHECKED and len(errors) == 2, errors
    assert "must be >= guaranteedBlocks" not in " ".join(errors)
    both = validate_object(_tenant(tenantId="Acme Corp", kvCache=_kv(guaranteedBlocks=30)))
    assert len(both) == 2 and RULES_NOT_CHECKED not in both, both
    assert "maxBlocks (20) must be >= guaranteedBlocks (30)" in both[1]


def test_an_unknown_field_is_the_only_error_as_the_servers_strict_decoding_says() -> None:
    errors = validate_object(_tenant(quota=5, tier="gold", kvCache=_kv(guaranteedBlocks=30)))
    assert errors == ['unknown field "spec.quota"']


def test_metadata_name_must_be_a_tenant_id_when_tenant_id_is_unset() -> None:
    doc = _tenant()
    doc["metadata"]["name"] = "acme.corp-" + "x" * 60  # a valid object name
    errors = validate_object(doc)
    assert errors and "metadata.name must be a valid tenant id" in errors[0]
    doc["spec"]["tenantId"] = "acme"
    assert validate_object(doc) == []


def test_tenant_id_is_immutable_on_update() -> None:
    old = _tenant(tenantId="acme")
    new = _tenant(tenantId="acme-2")
    errors = validate_object(new, old=validate_object(old) or old)
    assert errors == ["spec: Invalid value: tenantId is immutable"]
    assert validate_object(_tenant(tenantId="acme"), old=old) == []


def test_wrong_kind_is_refused_with_the_expected_kinds() -> None:
    errors = validate_object({"apiVersion": "kvquota.dev/v1", "kind": "Quota",
                              "metadata": {"name": "x"}})
    assert "expected apiVersion kvquota.dev/v1alpha1" in errors[0]


def test_defaults_are_applied_like_the_api_server() -> None:
    doc = _pool(kvCache={})
    assert validate_object(doc) == []
    assert doc["spec"]["kvCache"] == {"blockSize": 16, "watermark": 0.15}
    assert doc["spec"]["preemption"] == {"recomputeBelowBlocks": 128}
