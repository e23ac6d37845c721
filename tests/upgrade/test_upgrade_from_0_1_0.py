"""A team upgrades the KVQuota images under pod templates 0.1.0 injected and keeps the
templates as they are in Git. Each must still start: vLLM accepts its engine's
arguments, its `--scheduler-cls` and its pre-flight init container load today's plugin
copy (what `kvquota install-plugin` writes), and today's sidecar runs its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from sidecar.helpers import Keys, ServerThread, hs_auth, make_policy, tenant

from engine_sidecar.cli import build_gateway, check_server_flags, install_plugin
from engine_sidecar.contract.names import PLUGIN_CLASS, POOL_LABEL
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.renamed import BY_OLD
from kvquota.cli import build_parser
from kvquota.inject.pod import CHECK, SIDECAR
from kvquota.inject.vllm_argv import VllmCommand

from .conftest import NAMES, container, load_old, pod_spec

OLD_CLASS = "engine_sidecar.scheduler.TenantAwareScheduler"
OLD_CHECK = "engine_sidecar.preflight"
PLUGIN_DIR = "/opt/kvquota/python"  # the injected volume holding the plugin copy
RUN_DIR = "/var/run/kvquota"
SECRETS_DIR = "/etc/kvquota/secrets"


def _vllm(obj: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(obj)["containers"] if c["name"] != SIDECAR]
    return found


@pytest.mark.parametrize("name", NAMES)
def test_vllm_accepts_the_engine_arguments_0_1_0_injected(
    name: str, vllm_parser: argparse.ArgumentParser,
) -> None:
    parsed = vllm_parser.parse_args(VllmCommand.parse(_vllm(load_old(name))).server_argv())
    assert parsed.scheduler_cls == OLD_CLASS
    assert parsed.scheduling_policy == "priority"
    assert parsed.enable_prefix_caching is True


# Run in the engine's place: resolve the class path as vLLM's EngineCore does, then run
# the check container's own `-m MODULE ARGS` as `python -m` would.
ENGINE_SIDE = textwrap.dedent("""
    import runpy, sys
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = resolve_obj_by_qualname(sys.argv[1])
    assert issubclass(cls, Scheduler), cls
    print("loaded", cls.__module__, cls.__qualname__, sys.modules[cls.__module__].__file__,
          flush=True)
    module, sys.argv = sys.argv[3], [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
""")


def test_the_0_1_0_class_path_and_check_run_on_todays_plugin_copy(tmp_path: Path) -> None:
    """Every fixture names the same class path and check command: one run covers all."""
    commands = {(VllmCommand.parse(_vllm(load_old(n))).find("scheduler-cls")[0].value,
                 tuple(container(load_old(n), CHECK)["command"][1:])) for n in NAMES}
    assert commands == {(OLD_CLASS, ("-m", OLD_CHECK, "--strict"))}
    copy = install_plugin(tmp_path / "python")
    check = container(load_old(NAMES[0]), CHECK)
    env = {e["name"]: e["value"].replace(PLUGIN_DIR, str(copy.parent))
           for e in check["env"] if "value" in e and e["name"] in ("PYTHONPATH",)}
    assert env == {"PYTHONPATH": str(copy.parent)}
    script = tmp_path / "engine_side.py"
    script.write_text(ENGINE_SIDE)
    run = subprocess.run(
        [sys.executable, str(script), OLD_CLASS, "-m", OLD_CHECK, "--strict"],
        cwd=copy.parent,  # the check container's workingDir: the copy
        env={**os.environ, **env, "PYTHONSAFEPATH": "1"},
        capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    module, _, cls = PLUGIN_CLASS.rpartition(".")
    assert f"loaded {module} {cls} {copy}/plugin/scheduler.py" in run.stdout
    assert re.search(r"^ok: vLLM \S+: admit, preempt, lease, finish", run.stdout, re.M)
    for old in (OLD_CLASS, OLD_CHECK):  # each logged once, naming its successor
        assert run.stderr.count(BY_OLD[old].message()) == 1, run.stderr


def _field(obj: dict[str, Any], path: str) -> str:
    """What the kubelet gives a `fieldRef` in a pod of `obj` (its IP: loopback here)."""
    labels = pod_spec_metadata(obj).get("labels", {})
    return {"metadata.namespace": obj["metadata"].get("namespace", "default"),
            "metadata.name": obj["metadata"].get("name") or obj["metadata"]["generateName"],
            "status.podIP": "127.0.0.1",
            f"metadata.labels['{POOL_LABEL}']": labels.get(POOL_LABEL, "")}[path]


def pod_spec_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = obj["metadata"] if obj["kind"] == "Pod" else (
        obj["spec"]["template"]["metadata"])
    return meta


def _sidecar_env(obj: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """The sidecar container's environment as the kubelet sets it, with the pod's
    volumes at their paths under `tmp_path`."""
    env = {}
    for var in container(obj, SIDECAR)["env"]:
        if "value" in var:
            env[var["name"]] = var["value"].replace(RUN_DIR, str(tmp_path / "run"))
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = _field(obj, var["valueFrom"]["fieldRef"]["fieldPath"])
        else:  # a Secret's key
            env[var["name"]] = "secret-" + var["valueFrom"]["secretKeyRef"]["key"]
    return env


def _masked_sidecar(name: str) -> dict[str, Any]:
    """The sidecar container 0.1.0 injected, its serving port (vLLM's) masked."""
    sidecar = container(load_old(name), SIDECAR)
    command = [re.sub(r":\d+$", ":PORT", a) if a.startswith("0.0.0.0:") else a
               for a in sidecar["command"]]
    return {"command": command, "env": sidecar["env"]}


# Three starts cover all: every fixture's sidecar is one of these but for its port.
SIDECAR_STARTS = ["kserve-predictor-pod.yaml", "plain-deployment.yaml",
                  "production-stack-api-key.yaml"]  # its sidecar reads vLLM's key


def test_every_fixtures_sidecar_is_one_that_is_started_below() -> None:
    started = [_masked_sidecar(n) for n in SIDECAR_STARTS]
    assert all(_masked_sidecar(n) in started for n in NAMES)


@pytest.mark.parametrize("name", SIDECAR_STARTS)
async def test_todays_sidecar_runs_the_command_line_0_1_0_injected(
    name: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its flags parse, its environment names the pool's ConfigMap, and it hands the
    policy the operator wrote there to the plugin's file. In process, on a free loopback
    port (the pod's ports are its own); the Kubernetes API is KMock; no vLLM runs."""
    from kubernetes import client

    obj = load_old(name)
    env = _sidecar_env(obj, tmp_path)
    for key, value in {**env, "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, value)
    keys = Keys(tmp_path / "secrets").write()
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
            .replace(SECRETS_DIR, str(keys.dir)) for arg in container(obj, SIDECAR)["command"]]
    assert argv[:2] == ["kvquota", "sidecar"]
    args = build_parser().parse_args(argv[1:])
    check_server_flags(args)
    namespace, configmap = args.policy_configmap.split("/")
    assert configmap == f"{env['KVQUOTA_POOL']}-kvquota-policy"

    # The model's tokenizer is the policy's (no engine here to name it).
    policy = make_policy(tenant("acme"), auth=hs_auth(), model=str(tiny_model),
                         pool=f"{namespace}/{env['KVQUOTA_POOL']}")
    async with kmock.KubernetesEmulator() as server, kmock.Server(server) as http:
        server.resources.load_bundled()
        url = str(http.url).rstrip("/")

        def api_client() -> Any:
            configuration = client.Configuration()
            configuration.host = url
            return client.ApiClient(configuration)

        async with httpx.AsyncClient(timeout=60) as api:
            created = await api.post(f"{url}/api/v1/namespaces/{namespace}/configmaps", json={
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": configmap, "namespace": namespace},
                "data": {"policy.json": policy.to_json()}})
            assert created.status_code < 300, created.text
        gateway = build_gateway(args, api_client_factory=api_client)
        sidecar = await asyncio.to_thread(ServerThread(gateway.app, lifespan="on").start)
        try:
            plugin_file = Path(env["KVQUOTA_POLICY_PATH"])
            for _ in range(3000):
                if plugin_file.exists():
                    break
                await asyncio.sleep(0.02)
            written = EnginePolicy.from_json(plugin_file.read_text())
            assert written.version == policy.version
            async with httpx.AsyncClient(base_url=sidecar.url, timeout=60) as clients:
                assert (await clients.get("/healthz")).status_code == 200
            transport = httpx.ASGITransport(app=gateway.admin_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as admin:
                status = (await admin.get("/kvquota/status")).json()
                for _ in range(3000):  # the tokenizer loads in the background
                    reasons = (await admin.get("/readyz")).json()["reasons"]
                    if "tokenizer still loading" not in reasons:
                        break
                    await asyncio.sleep(0.02)
            assert status["policyVersion"] == policy.version and status["policyError"] is None
            # Ready but for the engine, which this test does not start.
            assert [r.split(" (")[0] for r in reasons] == ["engine unreachable"], reasons
        finally:
            await asyncio.to_thread(sidecar.stop)
