"""The operator's ServiceAccount may do what the operator does, and no more."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import build

# (API group, resource, verb) the operator needs: kopf's watches and annotation patches,
# status writes, the policy ConfigMap, engine pod discovery, Gateway API pools, Events.
NEEDED = [
    ("kvquota.dev", "inferencepools", "list"),
    ("kvquota.dev", "inferencepools", "watch"),
    ("kvquota.dev", "inferencepools", "patch"),
    ("kvquota.dev", "tenantquotas", "list"),
    ("kvquota.dev", "tenantquotas", "watch"),
    ("kvquota.dev", "tenantquotas", "patch"),
    ("kvquota.dev", "inferencepools/status", "patch"),
    ("kvquota.dev", "tenantquotas/status", "patch"),
    ("", "configmaps", "get"),
    ("", "configmaps", "create"),
    ("", "configmaps", "patch"),
    ("", "pods", "list"),
    ("inference.networking.k8s.io", "inferencepools", "get"),
    ("", "events", "create"),
    ("kopf.dev", "clusterkopfpeerings", "watch"),
    ("kopf.dev", "clusterkopfpeerings", "patch"),
    ("kopf.dev", "clusterkopfpeerings", "create"),
    # --namespace NS: kopf's namespaced peering (#45: it stayed paused without it).
    ("kopf.dev", "kopfpeerings", "list"),
    ("kopf.dev", "kopfpeerings", "watch"),
    ("kopf.dev", "kopfpeerings", "patch"),
    ("kopf.dev", "kopfpeerings", "create"),
]
# What it must not be able to do.
FORBIDDEN = [
    ("", "secrets", "get"),
    ("", "secrets", "list"),
    ("", "pods", "delete"),
    ("kvquota.dev", "tenantquotas", "delete"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "create"),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
]


def _operator_rules() -> list[dict[str, Any]]:
    objects = build("manifests/base")
    # Leader and standby run as the same account.
    ((account, namespace),) = {
        (o["spec"]["template"]["spec"]["serviceAccountName"], o["metadata"]["namespace"])
        for o in objects if o["kind"] == "Deployment"}
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects
             if o["kind"] in ("ClusterRole", "Role")}
    rules: list[dict[str, Any]] = []
    for binding in (o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if {"kind": "ServiceAccount", "name": account, "namespace": namespace} in [
            {k: s.get(k) for k in ("kind", "name", "namespace")} for s in binding["subjects"]
        ]:
            role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
            rules.extend(role["rules"])
    return rules


def _allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r.get("apiGroups", []) and resource in r.get("resources", [])
        and verb in r.get("verbs", [])
        for r in rules
    )


@pytest.mark.parametrize(("group", "resource", "verb"), NEEDED)
def test_operator_may(group: str, resource: str, verb: str) -> None:
    assert _allows(_operator_rules(), group, resource, verb)


@pytest.mark.parametrize(("group", "resource", "verb"), FORBIDDEN)
def test_operator_may_not(group: str, resource: str, verb: str) -> None:
    assert not _allows(_operator_rules(), group, resource, verb)


def test_operator_rules_name_everything_explicitly() -> None:
    for rule in _operator_rules():
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), rule
