"""The API server refuses bad objects with the messages local mode and the docs give,
keeps status apart from spec, and prunes what the schema does not declare."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from kvquota.api.validation import validate_object

from .conftest import FIELD_MANAGER, Cluster, dump, pool, quota

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    def edit(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return edit


def _drop(path: str) -> Edit:
    def edit(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = obj
        for key in parents:
            node = node[key]
        del node[last]
    return edit


# (id, kind, edit, what the user must read: the docs' and the CRDs' wording)
INVALID: list[tuple[str, str, Edit, str]] = [
    ("max-below-guarantee", "TenantQuota", _set("spec.kvCache.maxBlocks", 5),
     "must be >= guaranteedBlocks"),
    ("lease-above-max", "TenantQuota", _set("spec.kvCache.lease", {"maxBlocks": 500}),
     "must be <= maxBlocks"),
    ("default-above-max-tokens", "TenantQuota",
     _set("spec.limits", {"maxTokens": 64, "defaultMaxTokens": 128}),
     "limits.defaultMaxTokens must be <= limits.maxTokens"),
    ("unknown-tier", "TenantQuota", _set("spec.tier", "gold"), 'Unsupported value: "gold"'),
    ("negative-max", "TenantQuota", _set("spec.kvCache.maxBlocks", -1),
     "should be greater than or equal to 0"),
    ("no-pool-ref", "TenantQuota", _drop("spec.poolRef"), "spec.poolRef: Required value"),
    ("name-not-a-tenant-id", "TenantQuota", _set("metadata.name", "t" * 70),
     "metadata.name must be a valid tenant id"),
    ("selector-and-gateway-pool", "InferencePool",
     _set("spec.gatewayPoolRef", {"name": "gw-pool"}),
     "exactly one of selector or gatewayPoolRef must be set"),
    ("empty-selector", "InferencePool", _set("spec.selector", {}),
     "selector must have matchLabels or matchExpressions"),
    ("watermark-too-high", "InferencePool", _set("spec.kvCache.watermark", 0.7),
     "kvCache.watermark must be >= 0 and < 0.5"),
    ("block-size-not-multiple", "InferencePool", _set("spec.kvCache.blockSize", 24),
     "should be a multiple of 16"),
    ("mixed-jwt-algorithms", "InferencePool", _set("spec.auth", {"jwt": {
        "secretRef": {"name": "kvquota-auth", "key": "jwt.pub"},
        "algorithms": ["HS256", "RS256"]}}),
     "jwt.algorithms must not mix HMAC (HS*) with public-key algorithms"),
    ("anonymous-without-tenant", "InferencePool",
     _set("spec.auth", {"anonymous": {"allowed": True}}),
     "anonymous.tenantId is required when allowed"),
    ("tier-default-above-max", "InferencePool",
     _set("spec.tiers", {"premium": {"maxTokens": 64, "defaultMaxTokens": 128}}),
     "defaultMaxTokens must be <= maxTokens"),
    ("no-model", "InferencePool", _drop("spec.model"), "spec.model: Required value"),
]


def _local_fragments(obj: dict[str, Any]) -> list[str]:
    """What local mode says (from the generated CRDs: its CEL messages and
    messageExpressions evaluated), as the fragments the server's error must hold too:
    the field path and the message, without local mode's value rendering."""
    errors = validate_object(copy.deepcopy(obj))
    assert errors, f"local mode accepts {dump(obj)}"
    fragments = []
    for error in errors:
        path, _, message = error.partition(": ")
        if message.startswith("Invalid value: "):
            message = message.split(": ", 2)[-1]
        fragments += [f for f in (path, message) if f and f != "<nil>"]
    return fragments


def _refusal(cluster: Cluster, obj: dict[str, Any]) -> str:
    proc = cluster.kubectl.apply([obj], dry_run=True, check=False)
    assert proc.returncode != 0, f"the server accepted it:\n{dump(obj)}\n{proc.stdout}"
    return proc.stderr + proc.stdout


@pytest.mark.parametrize(("kind", "edit", "shown"), [r[1:] for r in INVALID],
                         ids=[r[0] for r in INVALID])
def test_invalid_object_is_refused_with_the_documented_message(
    api: Cluster, namespace: str, kind: str, edit: Edit, shown: str
) -> None:
    obj = pool("bad-pool", namespace) if kind == "InferencePool" else quota("bad", namespace)
    edit(obj)
    said = _refusal(api, obj)
    assert shown in said, f"expected {shown!r} in:\n{said}"
    missing = [f for f in _local_fragments(obj) if f not in said]
    assert not missing, f"local mode says {missing}, the server:\n{said}"


def test_unknown_field_is_refused(api: Cluster, namespace: str) -> None:
    obj = quota("typo", namespace)
    obj["spec"]["replicas"] = 2
    said = _refusal(api, obj)
    assert "spec.replicas" in said and (
        "field not declared in schema" in said or "unknown field" in said), said


def test_tenant_id_is_immutable(api: Cluster, namespace: str) -> None:
    obj = quota("pinned", namespace)
    obj["spec"]["tenantId"] = "pinned-id"
    api.kubectl.apply([obj])
    obj["spec"]["tenantId"] = "renamed-id"
    proc = api.kubectl.apply([obj], check=False)
    said = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "tenantId is immutable" in said, said
    live = api.kubectl.get("tenantquotas.kvquota.dev", "pinned", namespace)
    assert live["spec"]["tenantId"] == "pinned-id"


def _patch_status(cluster: Cluster, kind: str, name: str, namespace: str,
                  status: dict[str, Any]) -> dict[str, Any]:
    out = cluster.kubectl.run(
        "patch", kind, name, "-n", namespace, "--subresource=status", "--type=merge",
        f"--field-manager={FIELD_MANAGER}", "-p", json.dumps({"status": status}),
        "-o", "json").stdout
    result: dict[str, Any] = json.loads(out)
    return result


def test_status_is_a_subresource_and_pruned_to_its_schema(api: Cluster, namespace: str) -> None:
    """Spec edits bump the generation and ignore status; status writes go through
    /status, keep declared fields and drop the rest (structural pruning): what the
    operator writes must be declared, or it silently disappears."""
    obj = pool("status-pool", namespace)
    obj["status"] = {"tenants": 99}
    api.kubectl.apply([obj])
    live = api.kubectl.get("inferencepools.kvquota.dev", "status-pool", namespace)
    assert "status" not in live or "tenants" not in live["status"], dump(live)
    written = _patch_status(api, "inferencepools.kvquota.dev", "status-pool", namespace,
                            {"tenants": 3, "observedGeneration": 1, "madeUp": "gone"})
    assert written["status"]["tenants"] == 3 and "madeUp" not in written["status"]
    assert written["metadata"]["generation"] == 1
    obj["spec"]["model"] = "tiny-2"
    api.kubectl.apply([obj])
    live = api.kubectl.get("inferencepools.kvquota.dev", "status-pool", namespace)
    assert live["metadata"]["generation"] == 2
    assert live["status"]["tenants"] == 3, dump(live)


def test_second_field_manager_reapplies_without_conflict(api: Cluster, namespace: str) -> None:
    """GitOps: another applier (Flux, Argo CD without force) re-applies the same custom
    resources after status was written, and nothing conflicts."""
    objs = [pool("gitops-pool", namespace), quota("gitops", namespace, "gitops-pool")]
    api.kubectl.apply(objs, manager="kubectl")
    _patch_status(api, "tenantquotas.kvquota.dev", "gitops", namespace,
                  {"observedGeneration": 1})
    proc = api.kubectl.apply(objs, manager="gitops-resync", check=False)
    assert proc.returncode == 0, proc.stderr
    live = api.kubectl.get("tenantquotas.kvquota.dev", "gitops", namespace)
    managers = {m["manager"] for m in live["metadata"]["managedFields"]}
    assert {"kubectl", "gitops-resync", FIELD_MANAGER} <= managers, dump(live)
    assert live["status"]["observedGeneration"] == 1
