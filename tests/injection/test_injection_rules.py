"""What injection does to the real-world specs, rule by rule (the pure core, no server)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_sidecar.cli import install_plugin
from kvquota.inject.objects import inject_object
from kvquota.inject.pod import CHECK, INIT, PLUGIN_DIR, PROBE_PATHS, SIDECAR, InjectionRefused
from kvquota.inject.vllm_argv import SERVER_MODULE, VllmCommand, unwrap_shell

from .checks import check_injected_pod, vllm_container
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


def _check(pod: dict[str, Any]) -> dict[str, Any]:
    (check,) = [c for c in pod["spec"]["initContainers"] if c["name"] == CHECK]
    return check


@pytest.mark.parametrize("name", INJECTED)
def test_the_copied_plugin_is_checked_in_the_engines_image_before_vllm_starts(
    name: str,
) -> None:
    _before, after = _injected(name)
    vllm = vllm_container(after)
    init = after["spec"]["initContainers"]
    assert [c["name"] for c in init][-2:] == [INIT, CHECK]  # copied, then checked
    check = _check(after)
    assert check["image"] == vllm["image"]  # the vLLM the engine will run
    assert check["command"] == [VllmCommand.parse(vllm).python(), "-m",
                                "engine_sidecar.plugin.preflight", "--strict"]
    env = {e["name"]: e for e in check["env"]}
    assert env["PYTHONPATH"] == next(e for e in vllm["env"] if e["name"] == "PYTHONPATH")
    assert {"name": "kvquota-python", "mountPath": PLUGIN_DIR,
            "readOnly": True} in check["volumeMounts"]
    assert check["securityContext"]["readOnlyRootFilesystem"] is True
    assert check["securityContext"]["runAsNonRoot"] is True
    # `kubectl describe pod` shows why the pod stopped at init.
    assert check["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize(("command", "python"), [
    (["python3.12", "-m", SERVER_MODULE], "python3.12"),
    (["/opt/venv/bin/python", "-u", "-m", SERVER_MODULE], "/opt/venv/bin/python"),
    (["/opt/venv/bin/vllm", "serve"], "/opt/venv/bin/python3"),
    (["vllm", "serve"], "python3"),
    (None, "python3"),  # the image's entrypoint starts vLLM
])
def test_the_check_runs_on_the_python_that_runs_vllm(
    command: list[str] | None, python: str
) -> None:
    pod = pod_of(load("plain-deployment.yaml"))
    vllm = pod["spec"]["containers"][0]
    if command is None:
        vllm.pop("command")
    else:
        vllm["command"] = command
    vllm["args"] = ["--model", "m"]
    assert _check(pod_of(inject_object(pod)))["command"][0] == python


def test_the_check_sees_the_engines_environment() -> None:
    """Like the engine, the check lets an unverified vLLM through only where the
    engine's container allows it."""
    pod = pod_of(load("plain-deployment.yaml"))
    vllm = pod["spec"]["containers"][0]
    vllm.setdefault("env", []).extend([
        {"name": "KVQUOTA_ALLOW_UNSUPPORTED_VLLM", "value": "1"},
        {"name": "HOME", "value": "/models"},  # not mounted in the check
    ])
    vllm["envFrom"] = [{"configMapRef": {"name": "vllm-settings"}}]
    check = _check(pod_of(inject_object(pod)))
    env = {e["name"]: e.get("value") for e in check["env"]}
    assert env["KVQUOTA_ALLOW_UNSUPPORTED_VLLM"] == "1"
    assert env["HOME"] == "/tmp"  # writable: the check's own emptyDir
    assert check["envFrom"] == vllm["envFrom"]


def test_the_injected_check_says_ok_on_this_vllm(tmp_path: Path) -> None:
    """The init container's command as injected, run here (this venv's python for the
    image's) on a copy of the plugin in place of the shared volume."""
    check = _check(pod_of(inject_object(load("plain-deployment.yaml"))))
    plugin = install_plugin(tmp_path / "python").parent
    env = {**os.environ, **{e["name"]: e["value"] for e in check["env"] if "value" in e}}
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(PLUGIN_DIR, str(plugin))
    env["HOME"] = str(tmp_path)
    env.pop("KVQUOTA_ALLOW_UNSUPPORTED_VLLM", None)
    assert check["workingDir"] == PLUGIN_DIR
    run = subprocess.run([sys.executable, *check["command"][1:]], cwd=plugin, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"checking the plugin at {plugin / 'engine_sidecar'} on vLLM " in run.stdout
    assert run.stdout.splitlines()[-1].endswith(": admit, preempt, lease, finish")


def test_vllm_serves_the_pools_model_name_unless_the_pod_names_its_own(
    vllm_parser: Any,
) -> None:
    """Responses carry the name clients ask for (the pool's spec.model), not a model
    directory; a pod that names its own served name keeps it."""
    plain = pod_of(inject_object(load("plain-deployment.yaml"), served_model_name="tiny"))
    assert check_injected_pod(plain, vllm_parser).served_model_name == ["tiny"]
    named = pod_of(inject_object(load("llm-d-decode.yaml"), served_model_name="tiny"))
    command = VllmCommand.parse(vllm_container(named))
    assert [f.value for f in command.find("served-model-name")] == ["Qwen/Qwen3-0.6B"]
    without = pod_of(inject_object(load("plain-deployment.yaml")))
    assert not VllmCommand.parse(vllm_container(without)).find("served-model-name")
