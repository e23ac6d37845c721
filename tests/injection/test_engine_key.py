"""vLLM's API key reaches the sidecar's environment, however the pod gives it to vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvquota.inject.objects import inject_object
from kvquota.inject.pod import SIDECAR, InjectionRefused

from .checks import check_injected_pod, vllm_container
from .conftest import load, pod_of


def _sidecar_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == SIDECAR]
    env: list[dict[str, Any]] = sidecar["env"]
    return env


def _key_entries(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in _sidecar_env(pod) if e["name"] == "VLLM_API_KEY"]


def test_the_charts_secret_reference_is_copied_to_the_sidecar(vllm_parser: Any) -> None:
    # production-stack's servingEngineSpec.vllmApiKey: VLLM_API_KEY from a Secret.
    pod = pod_of(inject_object(load("production-stack-api-key.yaml")))
    check_injected_pod(pod, vllm_parser)
    assert _key_entries(pod) == [{"name": "VLLM_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "vllm-secrets", "key": "vllmApiKey"}}}]
    # vLLM keeps its own (it still enforces the key on /v1/*).
    assert [e for e in vllm_container(pod)["env"] if e["name"] == "VLLM_API_KEY"] == \
        _key_entries(pod)


def _with_args(name: str, *extra: str, env: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
    obj = load(name)
    container = vllm_container(pod_of(obj))
    spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
    (target,) = [c for c in spec["containers"] if c["name"] == container["name"]]
    target.setdefault("args", []).extend(extra)
    if env is not None:
        target.setdefault("env", []).extend(env)
    return obj


def test_an_api_key_flag_becomes_the_sidecars_key(vllm_parser: Any) -> None:
    pod = pod_of(inject_object(_with_args("plain-deployment.yaml", "--api-key",
                                          "literal-test-key", "second-test-key")))
    parsed = check_injected_pod(pod, vllm_parser)
    assert parsed.api_key == ["literal-test-key", "second-test-key"]  # vLLM's flags kept
    assert _key_entries(pod) == [{"name": "VLLM_API_KEY", "value": "literal-test-key"}]


def test_a_key_flag_that_names_a_variable_brings_the_variable_along(vllm_parser: Any) -> None:
    secret_env = [{"name": "SERVING_KEY", "valueFrom": {
        "secretKeyRef": {"name": "serving", "key": "api-key"}}}]
    pod = pod_of(inject_object(_with_args("plain-deployment.yaml", "--api-key=$(SERVING_KEY)",
                                          env=secret_env)))
    check_injected_pod(pod, vllm_parser)
    env = _sidecar_env(pod)
    names = [e["name"] for e in env]
    # Kubernetes expands $(SERVING_KEY) only from variables defined before it.
    assert names.index("SERVING_KEY") < names.index("VLLM_API_KEY")
    assert env[names.index("SERVING_KEY")] == secret_env[0]
    assert _key_entries(pod) == [{"name": "VLLM_API_KEY", "value": "$(SERVING_KEY)"}]


def test_the_flag_wins_over_the_environment_as_in_vllm(vllm_parser: Any) -> None:
    env = [{"name": "VLLM_API_KEY", "value": "from-env"}]
    pod = pod_of(inject_object(_with_args("plain-deployment.yaml", "--api-key", "from-flag",
                                          env=env)))
    assert _key_entries(pod) == [{"name": "VLLM_API_KEY", "value": "from-flag"}]


def test_a_pod_without_a_key_gives_the_sidecar_none() -> None:
    pod = pod_of(inject_object(load("production-stack.yaml")))
    assert _key_entries(pod) == []


def test_a_key_named_after_a_sidecar_variable_is_refused() -> None:
    obj = _with_args("plain-deployment.yaml", "--api-key", "$(POD_NAME)",
                     env=[{"name": "POD_NAME", "value": "not-the-sidecars"}])
    with pytest.raises(InjectionRefused, match=r"\$POD_NAME, which the KVQuota sidecar sets"):
        inject_object(obj)


def test_injecting_twice_keeps_one_key() -> None:
    once = inject_object(load("production-stack-api-key.yaml"))
    assert inject_object(once) == once
    assert len(_key_entries(pod_of(once))) == 1
