"""What injection does to the real-world specs, rule by rule (the pure core, no server)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvquota.inject.objects import inject_object
from kvquota.inject.pod import PROBE_PATHS, SIDECAR, InjectionRefused
from kvquota.inject.vllm_argv import VllmCommand, unwrap_shell

from .checks import vllm_container
from .conftest import INJECTED, load, pod_of


def _injected(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    before = pod_of(load(name))
    return before, pod_of(inject_object(load(name)))


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == SIDECAR]
    return sidecar


def _client_port(sidecar: dict[str, Any]) -> dict[str, Any]:
    (port,) = [p for p in sidecar["ports"] if p["name"] != "admin"]
    return port


@pytest.mark.parametrize("name", INJECTED)
def test_the_sidecar_takes_over_vllms_serving_port_under_the_same_name(name: str) -> None:
    before, after = _injected(name)
    (served,) = [p for p in vllm_container(before).get("ports", [])
                 if p["containerPort"] == int(_serve_port(before))] or [None]
    port = _client_port(_sidecar(after))
    assert port["containerPort"] == int(_serve_port(before))
    if served is not None and "name" in served:
        assert port["name"] == served["name"]  # a Service's named targetPort still resolves
    assert all(p["containerPort"] != port["containerPort"]
               for p in vllm_container(after).get("ports", []))
    # vLLM moved to a loopback port no container of the pod declares.
    engine_port = int(_flag(after, "port"))
    declared = {p["containerPort"] for c in after["spec"]["containers"]
                + after["spec"].get("initContainers", []) for p in c.get("ports", [])}
    assert engine_port not in declared and _flag(after, "host") == "127.0.0.1"


def _flag(pod: dict[str, Any], name: str) -> str | None:
    container = copy.deepcopy(vllm_container(pod))
    unwrap_shell(container)  # the spec as written may start vLLM through `sh -c`
    flags = VllmCommand.parse(container).find(name)
    return flags[-1].value if flags else None


def _serve_port(pod: dict[str, Any]) -> str:
    return _flag(pod, "port") or "8000"


@pytest.mark.parametrize("name", INJECTED)
def test_probes_keep_reaching_a_route_that_answers_without_credentials(name: str) -> None:
    before, after = _injected(name)
    client = _client_port(_sidecar(after))["containerPort"]
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        old, new = vllm_container(before).get(kind), vllm_container(after).get(kind)
        assert (old is None) == (new is None)
        if new is None:
            continue
        assert new["httpGet"]["port"] == client  # by number: the port is the sidecar's now
        assert new["httpGet"]["path"] in PROBE_PATHS
        assert {k: v for k, v in new.items() if k != "httpGet"} == (
            {k: v for k, v in old.items() if k != "httpGet"})  # timings untouched


def test_the_users_pythonpath_keeps_its_entries_after_the_plugin() -> None:
    deployment = load("plain-deployment.yaml")
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    vllm["env"].append({"name": "PYTHONPATH", "value": "/app/lib"})
    env = {e["name"]: e for e in vllm_container(pod_of(inject_object(deployment)))["env"]}
    assert env["PYTHONPATH"]["value"] == "/opt/kvquota/python:/app/lib"


def test_a_shell_that_only_runs_vllm_becomes_the_exec_form() -> None:
    _before, after = _injected("vllm-docs-deployment.yaml")
    vllm = vllm_container(after)
    assert vllm["command"] == ["vllm", "serve"]
    assert vllm["args"][:5] == ["mistralai/Mistral-7B-Instruct-v0.3", "--trust-remote-code",
                                "--enable-chunked-prefill", "--max_num_batched_tokens", "1024"]
    assert "exec form" in after["metadata"]["annotations"]["kvquota.dev/replaced"]


@pytest.mark.parametrize("script", [
    "vllm serve $MODEL --port 8000",  # the shell expands it
    "pip install foo && vllm serve m",  # two commands
    "vllm serve m > /tmp/log",  # a redirection
    "vllm serve m\nsleep 1",  # two lines
])
def test_a_shell_script_that_does_more_is_refused_with_what_to_change(script: str) -> None:
    pod = load("refused-not-vllm.yaml")
    pod["spec"]["containers"][0].update(image="vllm/vllm-openai:v0.32.0",
                                        command=["/bin/sh", "-c"], args=[script])
    with pytest.raises(InjectionRefused, match=r"Pod default/tgi: .*shell script that does "
                       r"more than run one command"):
        inject_object(pod)


def test_two_vllm_servers_in_one_pod_are_refused() -> None:
    pod = pod_of(load("plain-deployment.yaml"))
    second = copy.deepcopy(pod["spec"]["containers"][0])
    pod["spec"]["containers"].append({**second, "name": "second", "ports": []})
    with pytest.raises(InjectionRefused, match="several containers run vLLM"):
        inject_object(pod)
