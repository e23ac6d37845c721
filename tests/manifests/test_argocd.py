"""Argo CD: the health checks for our kinds (run with a Lua 5.1 interpreter, as Argo
CD's gopher-lua runs them), their embedding into argocd-cm, and the sync waves."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

from engine_sidecar.contract.policy import Tier
from kvquota.policy.plan import plan_pool
from kvquota.reconcile.status import EngineView, pool_status, tenant_status
from kvquota.reconcile.sync import PolicyHistory
from kvquota.reconcile.usage import Disruptions

from .conftest import MANIFESTS, REPO, build, one

HEALTH = MANIFESTS / "argocd" / "health"
KEY = "resource.customizations.health.kvquota.dev_{kind}"


def health(kind: str, obj: dict[str, Any]) -> dict[str, str]:
    """Run the check as Argo CD does: the object as the global table `obj`."""
    script = (HEALTH / "kvquota.lua").read_text()
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from({**obj, "kind": kind}, recursive=True)
    result = dict(lua.execute(script))
    assert result["status"] in {"Healthy", "Progressing", "Degraded"}
    assert result["message"], "Argo CD shows the message next to the status"
    return result


def _cond(type_: str, status: str, reason: str = "Reason", message: str = "",
          generation: int = 1) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": "2026-01-01T00:00:00Z"}


def _obj(*conditions: dict[str, Any], generation: int = 1,
         observed: int | None = 1) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": list(conditions)}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"name": "x", "generation": generation}, "status": status}


NO_STATUS = {"metadata": {"name": "x", "generation": 1}}
EMPTY_STATUS = {"metadata": {"name": "x", "generation": 1}, "status": {}}

TENANT_CASES = [
    ("no status yet", NO_STATUS, "Progressing"),
    ("empty status", EMPTY_STATUS, "Progressing"),
    ("ready and accepted",
     _obj(_cond("Accepted", "True"), _cond("Ready", "True"), _cond("Degraded", "False")),
     "Healthy"),
    ("ready and accepted, degraded unknown",
     _obj(_cond("Accepted", "True"), _cond("Ready", "True"), _cond("Degraded", "Unknown")),
     "Healthy"),
    ("spec edited, status not caught up",
     _obj(_cond("Accepted", "True"), _cond("Ready", "True"), generation=2, observed=1),
     "Progressing"),
    ("stale condition without top-level observedGeneration",
     _obj(_cond("Accepted", "False", "Oversubscribed"), _cond("Ready", "True"),
          generation=3, observed=None),
     "Progressing"),
    ("does not fit the pool",
     _obj(_cond("Accepted", "False", "Oversubscribed", "asks 900 blocks"),
          _cond("Ready", "True")),
     "Degraded"),
    ("premium leases released",
     _obj(_cond("Accepted", "True"), _cond("Ready", "True"),
          _cond("Degraded", "True", "DegradedMode")),
     "Degraded"),
    ("pool missing",
     _obj(_cond("Accepted", "Unknown"), _cond("Ready", "False", "PoolNotFound")),
     "Degraded"),
    ("engines still syncing",
     _obj(_cond("Accepted", "True"), _cond("Ready", "False", "NotSynced")),
     "Progressing"),
    ("all unknown",
     _obj(_cond("Accepted", "Unknown"), _cond("Ready", "Unknown")),
     "Progressing"),
]

POOL_CASES = [
    ("no status yet", NO_STATUS, "Progressing"),
    ("ready and synced",
     _obj(_cond("Ready", "True"), _cond("Synced", "True"), _cond("Oversubscribed", "False")),
     "Healthy"),
    ("engines loading the model",
     _obj(_cond("Ready", "False", "EnginesNotReady"), _cond("Synced", "Unknown")),
     "Progressing"),
    ("gateway pool missing",
     _obj(_cond("Ready", "False", "GatewayPoolNotFound"), _cond("Synced", "Unknown")),
     "Degraded"),
    ("policy rolling out",
     _obj(_cond("Ready", "True"), _cond("Synced", "False", "EnginesNotSynced")),
     "Progressing"),
    ("invalid spec",
     _obj(_cond("Ready", "False", "InvalidSpec", "spec.model: too long"),
          _cond("Synced", "Unknown")),
     "Degraded"),
    ("guarantees exceed capacity",
     _obj(_cond("Ready", "True"), _cond("Synced", "True"),
          _cond("Oversubscribed", "True", "GuaranteesExceedCapacity")),
     "Degraded"),
    ("spec edited, status not caught up",
     _obj(_cond("Ready", "True"), _cond("Synced", "True"),
          _cond("Oversubscribed", "True"), generation=5, observed=4),
     "Progressing"),
]


def _ids(cases: list[tuple[str, Any, str]]) -> list[str]:
    return [c[0] for c in cases]


@pytest.mark.parametrize(("case", "obj", "expected"), TENANT_CASES, ids=_ids(TENANT_CASES))
def test_tenantquota_health(case: str, obj: dict[str, Any], expected: str) -> None:
    assert health("TenantQuota", obj)["status"] == expected


@pytest.mark.parametrize(("case", "obj", "expected"), POOL_CASES, ids=_ids(POOL_CASES))
def test_inferencepool_health(case: str, obj: dict[str, Any], expected: str) -> None:
    assert health("InferencePool", obj)["status"] == expected


def test_degraded_message_says_why() -> None:
    obj = _obj(_cond("Accepted", "False", "Oversubscribed", "asks 900 blocks, 544 fit"))
    assert health("TenantQuota", obj) == {
        "status": "Degraded",
        "message": "Accepted=False (Oversubscribed): asks 900 blocks, 544 fit",
    }


# -------------------------------------------- statuses the operator really writes


NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _samples() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted((MANIFESTS / "samples").glob("*.yaml"))]
    pool = next(d for d in docs if d.get("kind") == "InferencePool")
    tenants = [d for d in docs if d.get("kind") == "TenantQuota"]
    for doc in [pool, *tenants]:
        doc["metadata"]["generation"] = 1
    return pool, tenants


def _statuses(pool: dict[str, Any] | None, tenants: list[dict[str, Any]], *, ready: int,
              matched: int, disruptions: Disruptions | None = None
              ) -> dict[str, dict[str, Any]]:
    """Status of every object, written by the operator's own status functions."""
    meta = (pool or tenants[0])["metadata"]
    name = pool["metadata"]["name"] if pool else tenants[0]["spec"]["poolRef"]["name"]
    plan = plan_pool(pool, tenants, namespace=meta["namespace"], name=name,
                     ready_replicas=ready)
    assert plan.tenants is not None
    history = PolicyHistory()
    if plan.policy is not None:
        history.record(plan.policy)
    version = plan.policy.version if plan.policy else None
    engines = EngineView(ready=ready, matched=matched,
                         versions={f"engine-{i}": version for i in range(ready)})
    out = {}
    if pool is not None:
        out["InferencePool"] = pool_status(plan, engines=engines, old=None, generation=1,
                                           now=NOW)
    for tenant in tenants:
        key = (tenant["metadata"]["namespace"], tenant["metadata"]["name"])
        out[tenant["metadata"]["name"]] = tenant_status(
            plan.tenants[key], plan, engines=engines, history=history,
            disruptions=disruptions, old=None, generation=1, now=NOW,
        )
    return out


def _with(doc: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "status": status}


@pytest.mark.parametrize("matched", [0, 1], ids=["no engine pod yet", "engine pod starting"])
def test_operator_statuses_while_engines_start_are_progressing(matched: int) -> None:
    pool, tenants = _samples()
    statuses = _statuses(pool, tenants, ready=0, matched=matched)
    got = health("InferencePool", _with(pool, statuses["InferencePool"]))
    assert got["status"] == "Progressing", got
    for tenant in tenants:
        got = health("TenantQuota", _with(tenant, statuses[tenant["metadata"]["name"]]))
        assert got["status"] == "Progressing"


def test_operator_statuses_of_a_synced_pool_are_healthy() -> None:
    pool, tenants = _samples()
    quiet = Disruptions(lease_breaks=0, preemptions=0, degraded_events=0, complete=True)
    statuses = _statuses(pool, tenants, ready=2, matched=2, disruptions=quiet)
    assert health("InferencePool", _with(pool, statuses["InferencePool"]))["status"] == "Healthy"
    for tenant in tenants:
        got = health("TenantQuota", _with(tenant, statuses[tenant["metadata"]["name"]]))
        assert got["status"] == "Healthy", got


def test_operator_statuses_of_an_oversubscribed_pool_are_degraded() -> None:
    pool, tenants = _samples()
    premium = next(t for t in tenants if t["spec"]["tier"] == Tier.PREMIUM)
    premium["spec"]["kvCache"].update(guaranteedBlocks=100_000, maxBlocks=100_000)
    premium["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"  # newest: refused
    statuses = _statuses(pool, tenants, ready=1, matched=1)
    assert health("InferencePool", _with(pool, statuses["InferencePool"]))["status"] == "Degraded"
    got = health("TenantQuota", _with(premium, statuses[premium["metadata"]["name"]]))
    assert got["status"] == "Degraded"


def test_operator_statuses_of_tenants_without_their_pool_are_degraded() -> None:
    _, tenants = _samples()
    statuses = _statuses(None, tenants, ready=0, matched=0)
    for tenant in tenants:
        got = health("TenantQuota", _with(tenant, statuses[tenant["metadata"]["name"]]))
        assert got["status"] == "Degraded", got


def test_operator_statuses_with_lease_breaks_are_degraded() -> None:
    pool, tenants = _samples()
    breaks = Disruptions(lease_breaks=3, preemptions=0, degraded_events=0, complete=True)
    statuses = _statuses(pool, tenants, ready=1, matched=1, disruptions=breaks)
    premium = next(t for t in tenants if t["spec"]["tier"] == Tier.PREMIUM)
    got = health("TenantQuota", _with(premium, statuses[premium["metadata"]["name"]]))
    assert got["status"] == "Degraded" and "lease breaks" in got["message"]


# -------------------------------------------- argocd-cm and the Application


def test_argocd_cm_embeds_the_health_scripts_unchanged() -> None:
    cm = one(build("manifests/argocd"), "ConfigMap", "argocd-cm")
    assert cm["metadata"]["namespace"] == "argocd"
    assert cm["data"] == {
        KEY.format(kind="InferencePool"): (HEALTH / "kvquota.lua").read_text(),
        KEY.format(kind="TenantQuota"): (HEALTH / "kvquota.lua").read_text(),
    }


def test_application_syncs_a_path_that_builds() -> None:
    app = one(build("manifests/argocd"), "Application", "kvquota")
    path = Path(app["spec"]["source"]["path"])
    assert (REPO / path / "kustomization.yaml").is_file()
    assert build(path)


def _wave(obj: dict[str, Any]) -> int:
    return int(obj["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


def test_sync_waves_create_api_then_operator_then_quotas() -> None:
    app = one(build("manifests/argocd"), "Application", "kvquota")
    waves: dict[str, set[int]] = {}
    for obj in build(app["spec"]["source"]["path"]):
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        stage = ("namespace" if obj["kind"] == "Namespace"
                 else "quotas" if group == "kvquota.dev" else "operator")
        waves.setdefault(stage, set()).add(_wave(obj))
    assert waves == {"namespace": {-1}, "operator": {0}, "quotas": {1}}


# -------------------------------------------- the API apart from the operator


CRDS = {"inferencepools.kvquota.dev", "tenantquotas.kvquota.dev",
        # kopf's peering CRDs: operator HA, cluster-wide and with --namespace
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
KEEP = "argocd.argoproj.io/sync-options"


def _crds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["metadata"]["name"] for o in objects
            if o["kind"] == "CustomResourceDefinition" and o["metadata"]["name"] in CRDS}


def test_the_operator_ships_without_the_crds() -> None:
    """`kubectl delete -k manifests/base`, or deleting the `kvquota` Application with its
    resources finalizer, removes only what these build: never a CRD, whose deletion
    would delete every pool and quota."""
    assert _crds(build("manifests/base")) == set()
    app = one(build("manifests/argocd"), "Application", "kvquota")
    assert _crds(build(app["spec"]["source"]["path"])) == set()


def test_the_crds_application_never_prunes_or_deletes_them() -> None:
    app = one(build("manifests/argocd"), "Application", "kvquota-crds")
    assert "finalizers" not in app["metadata"]  # deleting the app cascades to nothing
    assert app["spec"]["syncPolicy"]["automated"]["prune"] is False
    assert _wave(app) < _wave(one(build("manifests/argocd"), "Application", "kvquota"))
    objects = build(app["spec"]["source"]["path"])
    assert _crds(objects) == CRDS and len(objects) == len(CRDS)  # the API, nothing else
    for crd in objects:
        options = crd["metadata"]["annotations"][KEEP].split(",")
        assert {"Prune=false", "Delete=false"} <= set(options)
    # What Argo CD applies is exactly what `kvquota crds` generates.
    generated = {o["metadata"]["name"]: o["spec"] for o in build("crds")}
    assert {o["metadata"]["name"]: o["spec"] for o in objects} == generated


def test_quotas_wait_for_the_crds_of_the_other_application() -> None:
    app = one(build("manifests/argocd"), "Application", "kvquota")
    for obj in build(app["spec"]["source"]["path"]):
        if obj["apiVersion"].startswith("kvquota.dev/"):
            options = obj["metadata"]["annotations"][KEEP].split(",")
            assert "SkipDryRunOnMissingResource=true" in options
