"""Every kustomization under manifests/ builds, and every object it builds would be
accepted by the API server: built-in kinds against the Kubernetes OpenAPI schemas
(kubernetes-validate), our kinds against our CRDs, third-party CRs for the fields their
controllers cannot do without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvquota.validation import validate_object

from .conftest import REPO, build, kustomizations

# The oldest Kubernetes we support; kubernetes-validate ships its schemas.
KUBERNETES_VERSION = "1.30"

# Third-party CRDs we do not ship: the fields without which the object does nothing.
THIRD_PARTY_REQUIRED: dict[tuple[str, str], list[str]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): ["spec.selector", "spec.podMetricsEndpoints"],
    ("monitoring.coreos.com/v1", "PrometheusRule"): ["spec.groups"],
    ("argoproj.io/v1alpha1", "Application"): [
        "spec.project", "spec.source.repoURL", "spec.source.path", "spec.destination.server",
    ],
}


def _get(obj: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None  # type: ignore[assignment]
    return obj


def _errors(obj: dict[str, Any]) -> list[str]:
    api_version, kind = obj["apiVersion"], obj["kind"]
    if api_version.startswith("kvquota.dev/"):
        return validate_object(obj)
    if (api_version, kind) in THIRD_PARTY_REQUIRED:
        return [
            f"{path}: Required value"
            for path in THIRD_PARTY_REQUIRED[(api_version, kind)] if not _get(obj, path)
        ]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {api_version} {kind}: add it to THIRD_PARTY_REQUIRED"]
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return [f"{where}: {exc.message}"]
    return []


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
                      "ClusterRoleBinding"}
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
