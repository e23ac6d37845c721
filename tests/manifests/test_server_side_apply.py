"""Applying the manifests a second time, as another field manager, must not conflict
(issue #45, finding 5): no atomic struct may leave a field for the API server to fill
in (`atomic.py` says which and why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from .atomic import unfilled_atomic_fields
from .conftest import MANIFESTS, REPO, build, kustomizations


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("directory", kustomizations(), ids=_rel)
def test_built_manifests_spell_out_what_the_server_would_default(directory: Path) -> None:
    problems = [p for obj in build(directory) for p in unfilled_atomic_fields(obj)]
    assert problems == []


def test_every_manifest_file_spells_out_what_the_server_would_default() -> None:
    """Components and patches too, which build only inside a kustomization of yours."""
    problems = [
        f"{_rel(path)}: {problem}"
        for path in sorted(MANIFESTS.rglob("*.yaml"))
        for obj in yaml.safe_load_all(path.read_text())
        if isinstance(obj, dict)
        for problem in unfilled_atomic_fields(obj)
    ]
    assert problems == []


def test_the_check_finds_a_fieldref_without_its_api_version() -> None:
    """The operator Deployment as it was when a second applier conflicted on it."""
    deployment = next(o for o in build("manifests/base") if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (pod_id,) = [e for e in container["env"] if e["name"] == "POD_ID"]
    assert unfilled_atomic_fields(deployment) == []
    del pod_id["valueFrom"]["fieldRef"]["apiVersion"]
    assert unfilled_atomic_fields(deployment) == [
        "Deployment/kvquota-operator: .spec.template.spec.containers[operator].env[POD_ID]"
        ".valueFrom.fieldRef lacks apiVersion"]


def test_the_check_finds_defaults_inside_atomic_lists() -> None:
    policy = {"kind": "NetworkPolicy", "metadata": {"name": "p"}, "spec": {
        "ingress": [{"ports": [{"port": "http"}]}]}}
    webhooks = {"kind": "MutatingWebhookConfiguration", "metadata": {"name": "w"},
                "webhooks": [{"name": "inject.kvquota.dev", "rules": [
                    {"operations": ["CREATE"], "resources": ["pods"]}]}]}
    assert unfilled_atomic_fields(policy) == [
        "NetworkPolicy/p: .spec.ingress[0].ports[0] lacks protocol"]
    assert unfilled_atomic_fields(webhooks) == [
        "MutatingWebhookConfiguration/w: .webhooks[inject.kvquota.dev].rules[0] lacks scope"]
