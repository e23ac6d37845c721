"""The operator on a real API server, as a local process under its own ServiceAccount
(manifests/base's RBAC, no cluster-admin): it reconciles, its status survives the
schema, it posts events, owns its ConfigMap, restarts without rewriting, hands over to
its standby, runs namespaced with peering, and leaves GitOps appliers no conflict."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from .conftest import (
    MANIFESTS,
    OPERATOR_MANAGER,
    REPO,
    Cluster,
    Operator,
    condition,
    dump,
    in_namespace,
    pool,
    quota,
    wait_for,
)

POOLS, QUOTAS = "inferencepools.kvquota.dev", "tenantquotas.kvquota.dev"
CM_SUFFIX = "-kvquota-policy"  # kvquota.reconcile.configmap.configmap_name
SAMPLE_QUOTAS = ("acme", "globex", "hobbyist")
RECONCILE_S = 60  # a first reconcile: kopf's start, peering, the watch, the writes
RunOperator = Callable[..., Operator]


@pytest.fixture(scope="module")
def samples_ns(installed: Cluster, new_namespace: Callable[[str], str]) -> str:
    """The samples (one pool, three tenants) in a namespace of their own."""
    ns = new_namespace("operator")
    installed.kubectl.apply(in_namespace(installed.kubectl.kustomize(MANIFESTS / "samples"),
                                         ns), manager="kubectl")
    return ns


@pytest.fixture(scope="module")
def local_status(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What local mode renders for the samples (`kvquota operator --local ... --once`):
    the same logic, so the status the operator writes must keep all of it."""
    out = tmp_path_factory.mktemp("local")
    subprocess.run([sys.executable, "-m", "kvquota.cli", "operator", "--local",
                    str(MANIFESTS / "samples"), "--once", "--out", str(out)],
                   cwd=REPO, capture_output=True, timeout=120, check=True)
    return {p.name.split(".")[2]: yaml.safe_load(p.read_text())["status"]
            for p in (out / "status").glob("*.yaml")}


def _accepted(obj: dict[str, Any] | None) -> bool:
    return (condition(obj, "Accepted") or {}).get("status") == "True"


def _reconciled(obj: dict[str, Any] | None) -> bool:
    status = (obj or {}).get("status") or {}
    return bool(obj) and status.get("observedGeneration") == obj["metadata"]["generation"]


def _wait_quota(cluster: Cluster, ns: str, name: str, done: Callable[[Any], bool],
                what: str, operator: Operator, timeout: float = RECONCILE_S) -> Any:
    try:
        return wait_for(lambda: cluster.kubectl.get(QUOTAS, name, ns), done,
                        f"TenantQuota {ns}/{name} {what}", timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}\noperator {operator.name}'s log:\n"
                             f"{operator.output()}") from None


def _wait_samples(cluster: Cluster, ns: str, operator: Operator) -> dict[str, Any]:
    for name in SAMPLE_QUOTAS:
        _wait_quota(cluster, ns, name, lambda q: _accepted(q) and _reconciled(q),
                    "Accepted and reconciled", operator)
    return dict(wait_for(lambda: cluster.kubectl.get(POOLS, "demo-pool", ns),
                         lambda p: _reconciled(p) and p["status"].get("policyHash") and p[
                             "status"].get("tenants") == len(SAMPLE_QUOTAS),
                         "InferencePool demo-pool reconciled with the samples' policy",
                         timeout=RECONCILE_S))


def _versions(cluster: Cluster, ns: str) -> dict[str, str]:
    """resourceVersion of every pool, quota and ConfigMap in the namespace."""
    versions = {}
    for kind in (POOLS, QUOTAS, "configmaps"):
        for obj in cluster.kubectl.items(kind, ns):
            versions[f"{kind}/{obj['metadata']['name']}"] = obj["metadata"]["resourceVersion"]
    return versions


def _settled(cluster: Cluster, ns: str, quiet_s: float = 4) -> dict[str, str]:
    """The namespace's versions once they hold still for `quiet_s`."""
    last: dict[str, dict[str, str]] = {"seen": {}}

    def unchanged() -> dict[str, str]:
        before = last["seen"]
        time.sleep(quiet_s)
        last["seen"] = _versions(cluster, ns)
        return last["seen"] if last["seen"] == before else {}

    return wait_for(unchanged, bool, "the operator's writes to settle", timeout=60,
                    interval=0)


def _status_managers(obj: dict[str, Any]) -> set[str]:
    return {m["manager"] for m in obj["metadata"].get("managedFields") or []
            if m.get("subresource") == "status"}


def test_operator_reconciles_under_its_own_service_account(
    installed: Cluster, samples_ns: str, run_operator: RunOperator,
    local_status: dict[str, dict[str, Any]],
) -> None:
    operator = run_operator("reconcile")
    demo = _wait_samples(installed, samples_ns, operator)

    # Status survives structural pruning: all that local mode renders is kept.
    local_pool = local_status["demo-pool"]
    for key in ("capacityBlocks", "guaranteedBlocks", "tenants"):
        assert demo["status"].get(key) == local_pool[key], dump(demo)
    assert {c["type"] for c in demo["status"]["conditions"]} == {
        c["type"] for c in local_pool["conditions"]}
    for name in SAMPLE_QUOTAS:
        live = installed.kubectl.get(QUOTAS, name, samples_ns)
        expected = local_status[name]["effective"]
        kept = {k: v for k, v in live["status"].get("effective", {}).items() if k in expected}
        assert kept == expected, dump(live)
        assert {c["type"] for c in live["status"]["conditions"]} == {
            "Accepted", "Ready", "Degraded"}, dump(live)
        assert _status_managers(live) == {OPERATOR_MANAGER}, dump(live["metadata"])
    assert _status_managers(demo) == {OPERATOR_MANAGER}, dump(demo["metadata"])

    # The policy ConfigMap, owned by the pool (the garbage collector's cue).
    cm = installed.kubectl.get("configmap", "demo-pool" + CM_SUFFIX, samples_ns)
    assert cm is not None, f"no policy ConfigMap; log:\n{operator.output()}"
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner.get("controller")) == (
        "InferencePool", "demo-pool", demo["metadata"]["uid"], True), dump(cm["metadata"])
    assert cm["metadata"]["annotations"]["kvquota.dev/policy-hash"] == demo["status"][
        "policyHash"]
    managers = {m["manager"] for m in cm["metadata"]["managedFields"]}
    assert managers == {OPERATOR_MANAGER}, dump(cm["metadata"])

    # Events a user reads with `kubectl describe kvpool`.
    events = wait_for(
        lambda: installed.kubectl.items("events", samples_ns,
                                        "--field-selector=involvedObject.name=demo-pool"),
        lambda items: any(e["reason"] == "PolicyUpdated" for e in items),
        "a PolicyUpdated event on demo-pool")
    posted = next(e for e in events if e["reason"] == "PolicyUpdated")
    assert posted["involvedObject"]["uid"] == demo["metadata"]["uid"], dump(posted)


def test_restart_rewrites_nothing(
    installed: Cluster, samples_ns: str, run_operator: RunOperator
) -> None:
    first = run_operator("before-restart")
    _wait_samples(installed, samples_ns, first)
    before = _settled(installed, samples_ns)
    first.stop()
    second = run_operator("after-restart")
    wait_for(second.health, lambda h: (h or {}).get("reconciles", 0) >= 1,
             "the restarted operator to reconcile the pool again", timeout=RECONCILE_S)
    time.sleep(5)  # the quotas' turn, and any write it would make
    after = _versions(installed, samples_ns)
    changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
    assert not changed, f"rewritten after a restart (before, after): {changed}\n" \
                        f"log:\n{second.output()}"


def test_standby_takes_over_when_the_leader_stops(
    installed: Cluster, samples_ns: str, run_operator: RunOperator
) -> None:
    """The leader (priority 300) works, the standby (200) stays paused (its reconciler
    never runs: kopf starts --require-peering replicas paused), and takes over when
    the leader stops."""
    kubectl = installed.kubectl
    leader = run_operator("leader", priority=300)
    _wait_samples(installed, samples_ns, leader)
    standby = run_operator("standby", priority=200)
    peering = wait_for(lambda: kubectl.get("clusterkopfpeerings.kopf.dev", "kvquota"),
                       lambda p: {"leader", "standby"} <= set((p or {}).get("status") or {}),
                       "both replicas in the ClusterKopfPeering kvquota")
    kubectl.apply([quota("early", samples_ns)], manager="kubectl")
    _wait_quota(installed, samples_ns, "early", lambda q: _accepted(q) and _reconciled(q),
                "Accepted by the leader", leader)
    assert (standby.health() or {}).get("reconciles") == 0, (
        f"the standby reconciled beside the leader:\n{standby.output()}")
    leader.stop()
    kubectl.apply([quota("late", samples_ns)], manager="kubectl")
    _wait_quota(installed, samples_ns, "late", lambda q: _accepted(q) and _reconciled(q),
                "Accepted by the standby", standby, timeout=30)
    assert (standby.health() or {}).get("reconciles", 0) >= 1, standby.output()
    after = kubectl.get("clusterkopfpeerings.kopf.dev", "kvquota")
    assert "leader" not in (after.get("status") or {}), dump({"before": peering,
                                                              "after": after})
    kubectl.run("delete", QUOTAS, "early", "late", "-n", samples_ns)


def test_gitops_reapply_after_status_writes_conflicts_with_nothing(
    installed: Cluster, samples_ns: str, run_operator: RunOperator
) -> None:
    """A second applier (Flux, Argo CD without force) re-applies everything README
    installs after the operator wrote status, caBundle and ConfigMaps."""
    operator = run_operator("gitops")
    _wait_samples(installed, samples_ns, operator)
    samples = in_namespace(installed.kubectl.kustomize(MANIFESTS / "samples"), samples_ns)
    for name, what in (("manifests/crds", str(MANIFESTS / "crds")),
                       ("manifests/base", str(MANIFESTS / "base")), ("the samples", samples)):
        proc = installed.kubectl.apply(what, manager="gitops-resync", check=False)
        assert proc.returncode == 0, f"re-applying {name} conflicts:\n{proc.stderr}"
    demo = installed.kubectl.get(POOLS, "demo-pool", samples_ns)
    assert demo["status"].get("policyHash"), dump(demo)


def test_deleting_a_pool_removes_what_the_operator_made(
    installed: Cluster, samples_ns: str, run_operator: RunOperator
) -> None:
    kubectl = installed.kubectl
    kubectl.apply([pool("doomed", samples_ns), quota("orphan", samples_ns, "doomed")])
    operator = run_operator("pool-delete")
    cm = wait_for(lambda: kubectl.get("configmap", "doomed" + CM_SUFFIX, samples_ns), bool,
                  "the doomed pool's policy ConfigMap", timeout=RECONCILE_S)
    assert not kubectl.get(POOLS, "doomed", samples_ns)["metadata"].get("finalizers")
    kubectl.run("delete", POOLS, "doomed", "-n", samples_ns, "--wait=false")
    wait_for(lambda: kubectl.get(POOLS, "doomed", samples_ns), lambda p: p is None,
             "the pool to go (no finalizer may hold it)", timeout=30)
    _wait_quota(installed, samples_ns, "orphan", lambda q: any(
        c.get("reason") == "PoolNotFound" for c in (q or {}).get("status", {}).get(
            "conditions") or []), "told PoolNotFound", operator)
    kubectl.run("delete", QUOTAS, "orphan", "-n", samples_ns, "--wait=false")
    wait_for(lambda: kubectl.get(QUOTAS, "orphan", samples_ns), lambda q: q is None,
             "the quota to go (no finalizer may hold it)", timeout=30)
    try:
        wait_for(lambda: kubectl.get("configmap", "doomed" + CM_SUFFIX, samples_ns),
                 lambda c: c is None or c["metadata"]["uid"] != cm["metadata"]["uid"],
                 "the garbage collector to delete the policy ConfigMap", timeout=60)
    except AssertionError:
        if installed.controller_manager():
            raise
        pytest.skip("the policy ConfigMap (owned by the deleted pool) was not garbage "
                    "collected within 60 s, and no kube-controller-manager holds its lease "
                    "here: the garbage collector is not running")


def test_namespaced_mode_with_peering(
    installed: Cluster, new_namespace: Callable[[str], str], run_operator: RunOperator
) -> None:
    """`kvquota operator --namespace X --require-peering`: works in X, with the
    namespaced peering, under the same RBAC."""
    ns = new_namespace("namespaced")
    installed.kubectl.apply([pool("demo-pool", ns), quota("solo", ns)], manager="kubectl")
    operator = run_operator("namespaced", "--namespace", ns, "--require-peering",
                            priority=10)
    _wait_quota(installed, ns, "solo", lambda q: _accepted(q) and _reconciled(q),
                "Accepted by the namespaced operator", operator)
    peering = installed.kubectl.get("kopfpeerings.kopf.dev", "kvquota", ns)
    assert "namespaced" in ((peering or {}).get("status") or {}), dump(peering)

