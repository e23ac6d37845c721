"""Every kustomization under manifests/ builds, and every object it builds would be
accepted by the API server: built-in kinds against the Kubernetes OpenAPI schemas
(kubernetes-validate), our kinds against our CRDs, third-party CRs for the fields their
controllers cannot do without."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import REPO, build, kustomizations
from .schemas import schema_errors as _errors


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("directory", kustomizations(), ids=_rel)
def test_kustomization_builds_objects_the_api_server_accepts(directory: Path) -> None:
    objects = build(directory)
    assert objects, f"{_rel(directory)} builds nothing"
    problems = [
        f"{o['kind']}/{o['metadata'].get('name')}: {e}" for o in objects for e in _errors(o)
    ]
    assert problems == []


def test_every_namespaced_object_has_a_namespace() -> None:
    """`kubectl apply -k` would otherwise drop them into the caller's current namespace,
    away from the pool they belong to."""
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole",
                      "ClusterRoleBinding", "MutatingWebhookConfiguration"}
    missing = [
        f"{_rel(d)}: {o['kind']}/{o['metadata']['name']}"
        for d in kustomizations() for o in build(d)
        if o["kind"] not in cluster_scoped and not o["metadata"].get("namespace")
    ]
    assert missing == []


def test_the_validation_catches_a_broken_deployment() -> None:
    """Guards the check above: strict schemas refuse a misspelt field."""
    deployment = next(o for o in build("manifests/base") if o["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 1}}
    assert _errors(broken)
