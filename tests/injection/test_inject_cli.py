"""`kvquota inject` on the same real-world specs, as a GitOps user runs it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests.schemas import schema_errors

from kvquota.inject.pod import POOL_LABEL

from .checks import check_injected_pod
from .conftest import FIXTURES, INJECTED, REFUSED, load, pod_of

SERVICE = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "vllm", "namespace": "default"},
           "spec": {"selector": {"app": "vllm"}, "ports": [{"port": 8000}]}}


def _inject(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    script = shutil.which("kvquota")
    command = [script] if script else [sys.executable, "-m", "kvquota.cli"]
    return subprocess.run([*command, "inject", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj if obj["kind"] == "Pod" else pod_of(obj)


def test_a_multi_document_file_of_every_install_method_is_injected(
    tmp_path: Path, vllm_parser: argparse.ArgumentParser,
) -> None:
    bundle = tmp_path / "engines.yaml"
    bundle.write_text(yaml.safe_dump_all([load(n) for n in INJECTED] + [SERVICE]))
    result = _inject("-f", str(bundle))
    assert result.returncode == 0, result.stderr
    out = list(yaml.safe_load_all(result.stdout))
    assert [o["kind"] for o in out] == [load(n)["kind"] for n in INJECTED] + ["Service"]
    for obj in out[:-1]:
        assert schema_errors(obj) == []  # the workload itself, not only its pod
        check_injected_pod(_pod(obj), vllm_parser)
    assert out[-1] == SERVICE  # not a pod template: passed through


def test_stdin_and_a_pool_override(vllm_parser: argparse.ArgumentParser) -> None:
    plain = load("plain-deployment.yaml")
    del plain["spec"]["template"]["metadata"]["labels"][POOL_LABEL]
    result = _inject("-f", "-", "--pool", "other-pool", "--served-model-name", "tiny-llama",
                     stdin=yaml.safe_dump(plain))
    assert result.returncode == 0, result.stderr
    (out,) = yaml.safe_load_all(result.stdout)
    pod = _pod(out)
    assert check_injected_pod(pod, vllm_parser).served_model_name == ["tiny-llama"]
    assert pod["metadata"]["labels"][POOL_LABEL] == "other-pool"
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == "kvquota-sidecar"]
    # The sidecar loads `<pool>-kvquota-policy`, the pool read from that label.
    assert "$(POD_NAMESPACE)/$(KVQUOTA_POOL)-kvquota-policy" in sidecar["command"]
    (pool_env,) = [e for e in sidecar["env"] if e["name"] == "KVQUOTA_POOL"]
    assert pool_env["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POOL_LABEL}']"


def test_a_statefulset_is_injected_like_a_deployment(
    vllm_parser: argparse.ArgumentParser,
) -> None:
    workload = load("plain-deployment.yaml")
    workload.update(kind="StatefulSet")
    workload["spec"].pop("strategy", None)
    workload["spec"]["serviceName"] = "mistral-7b"
    result = _inject("-f", "-", stdin=yaml.safe_dump(workload))
    assert result.returncode == 0, result.stderr
    (out,) = yaml.safe_load_all(result.stdout)
    assert out["kind"] == "StatefulSet" and schema_errors(out) == []
    check_injected_pod(pod_of(out), vllm_parser)


def test_a_pod_that_opted_out_is_left_alone() -> None:
    pod = load("kserve-predictor-pod.yaml")
    pod["metadata"]["labels"]["kvquota.dev/injection"] = "disabled"
    result = _inject("-f", "-", stdin=yaml.safe_dump(pod))
    assert result.returncode == 0 and yaml.safe_load(result.stdout) == pod


def test_injecting_an_injected_file_changes_nothing() -> None:
    first = _inject("-f", str(FIXTURES / "production-stack.yaml"))
    second = _inject("-f", "-", stdin=first.stdout)
    assert second.returncode == 0 and second.stdout == first.stdout


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_pod_that_cannot_be_injected_fails_the_command_with_the_reason(name: str) -> None:
    result = _inject("-f", str(FIXTURES / name))
    assert result.returncode == 1 and result.stdout == ""
    assert REFUSED[name] in result.stderr
    assert f"{load(name)['kind']} default/{load(name)['metadata']['name']}" in result.stderr


def test_a_file_that_is_not_yaml_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Pod\n  spec: [\n")
    result = _inject("-f", str(broken))
    assert result.returncode == 2 and f"cannot read {broken}" in result.stderr


def test_the_store_password_comes_from_its_own_optional_secret() -> None:
    result = _inject("-f", "-", "--pool-store-secret", "redis-password",
                     stdin=yaml.safe_dump(load("plain-deployment.yaml")))
    assert result.returncode == 0, result.stderr
    (out,) = yaml.safe_load_all(result.stdout)
    pod = _pod(out)
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == "kvquota-sidecar"]
    command = sidecar["command"]
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    store = volumes[mounts[command[command.index("--pool-store-secrets-dir") + 1]]]
    auth = volumes[mounts[command[command.index("--secrets-dir") + 1]]]
    # Its own Secret, beside the auth one; optional, so pools without a store start.
    assert store["secret"] == {"secretName": "redis-password", "defaultMode": 0o444,
                               "optional": True}
    assert auth["secret"]["secretName"] == "kvquota-auth"
    # Only the sidecar mounts it.
    assert [c["name"] for c in pod["spec"]["containers"]
            if any(m["name"] == store["name"] for m in c.get("volumeMounts", []))] == [
        "kvquota-sidecar"]
