"""A stock vLLM Deployment becomes a KVQuota engine: the GPU example through the
injection webhook (its pod as admitted, `kvquota.inject`), and any labelled Deployment
through the engine-sidecar component."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .conftest import MANIFESTS, build, one

EXAMPLE = "manifests/examples/gpu-engine"


def _pod(objects: list[dict[str, Any]], name: str = "vllm-engine", *,
         admitted: bool = True) -> dict[str, Any]:
    """The Deployment's pod template; `admitted`: as the injection webhook admits its
    pods (the same code as `kvquota inject`)."""
    from kvquota.inject.objects import inject_object

    deployment = one(objects, "Deployment", name)
    if admitted:
        deployment = inject_object(deployment)
    spec: dict[str, Any] = deployment["spec"]["template"]
    return spec


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def test_vllm_keeps_its_model_and_loads_the_plugin_behind_the_sidecar() -> None:
    vllm = _container(_pod(build(EXAMPLE)), "vllm")
    args = vllm["args"]
    assert args[0] == "Qwen/Qwen2.5-1.5B-Instruct"
    for flag in (
        "--scheduler-cls=engine_sidecar.plugin.scheduler.TenantAwareScheduler",
        "--scheduling-policy=priority",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--port=8001",
        "--host=127.0.0.1",  # clients cannot bypass the sidecar's admission
    ):
        assert flag in args
    assert _env(vllm)["PYTHONPATH"] == "/opt/kvquota/python"
    assert all(p.get("containerPort") != 8000 for p in vllm.get("ports", []))


def test_plugin_is_copied_onto_a_volume_the_vllm_container_imports_from() -> None:
    pod = _pod(build(EXAMPLE))
    init, check = pod["spec"]["initContainers"]
    assert init["command"] == ["kvquota", "install-plugin", "/opt/kvquota/python"]
    target = _mounts(init)["/opt/kvquota/python"]
    assert _mounts(_container(pod, "vllm"))["/opt/kvquota/python"] == target
    assert init["image"] == _container(pod, "kvquota-sidecar")["image"]
    # Then the pre-flight check runs that copy on the vLLM the engine will run.
    vllm = _container(pod, "vllm")
    assert check["image"] == vllm["image"]
    assert check["command"] == ["python3", "-m", "engine_sidecar.plugin.preflight", "--strict"]
    assert _mounts(check)["/opt/kvquota/python"] == target
    assert _env(check)["PYTHONPATH"] == _env(vllm)["PYTHONPATH"]


def test_sidecar_and_plugin_share_the_policy_and_stats_files() -> None:
    pod = _pod(build(EXAMPLE))
    vllm, sidecar = _container(pod, "vllm"), _container(pod, "kvquota-sidecar")
    for container in (vllm, sidecar):
        env = _env(container)
        assert env["KVQUOTA_POLICY_PATH"] == "/var/run/kvquota/policy.json"
        assert env["KVQUOTA_STATS_PATH"] == "/var/run/kvquota/stats.json"
    volume = _mounts(sidecar)["/var/run/kvquota"]
    assert _mounts(vllm)["/var/run/kvquota"] == volume
    (spec,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    assert "emptyDir" in spec


def test_sidecar_loads_the_policy_configmap_of_the_pool_that_selects_the_engine() -> None:
    objects = build(EXAMPLE)
    pod = _pod(objects)
    sidecar = _container(pod, "kvquota-sidecar")
    command = sidecar["command"]
    configmap = command[command.index("--policy-configmap") + 1]
    assert configmap == "$(POD_NAMESPACE)/$(KVQUOTA_POOL)-kvquota-policy"
    env = _env(sidecar)
    assert env["POD_NAMESPACE"] == {
        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
    label = env["KVQUOTA_POOL"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['kvquota.dev/pool']"
    # What the downward API resolves $(KVQUOTA_POOL) to is the pool selecting this pod.
    pool = one(objects, "InferencePool")
    labels = pod["metadata"]["labels"]
    assert labels["kvquota.dev/pool"] == pool["metadata"]["name"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_sidecar_mounts_the_secret_the_pool_verifies_tokens_with() -> None:
    objects = build(EXAMPLE)
    pod = _pod(objects)
    sidecar = _container(pod, "kvquota-sidecar")
    command = sidecar["command"]
    secrets_dir = command[command.index("--secrets-dir") + 1]
    volume = _mounts(sidecar)[secrets_dir]
    (spec,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    jwt = one(objects, "InferencePool")["spec"]["auth"]["jwt"]
    assert spec["secret"]["secretName"] == jwt["secretRef"]["name"]
    assert not any(o["kind"] == "Secret" for o in objects), "secrets never ship in manifests"


def test_sidecar_mounts_the_store_password_from_its_own_optional_secret() -> None:
    pod = _pod(build(EXAMPLE))
    sidecar = _container(pod, "kvquota-sidecar")
    command = sidecar["command"]
    volume = _mounts(sidecar)[command[command.index("--pool-store-secrets-dir") + 1]]
    (spec,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    assert spec["secret"]["secretName"] == "kvquota-pool-store"
    assert spec["secret"]["optional"] is True  # pools without a store need none


def test_clients_reach_the_client_port_and_probes_the_admin_port() -> None:
    objects = build(EXAMPLE)
    sidecar = _container(_pod(objects), "kvquota-sidecar")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"http": 8000, "admin": 9100}
    # A flood on the client port must not restart the pod or make it unready.
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    (service_port,) = one(objects, "Service", "vllm-engine")["spec"]["ports"]
    assert service_port["port"] == 8000 and service_port["targetPort"] == "http"


def test_the_admin_port_is_the_one_the_operator_polls_bound_to_the_pod_ip() -> None:
    from kvquota.reconcile.engines import status_url

    pod = _pod(build(EXAMPLE))
    sidecar = _container(pod, "kvquota-sidecar")
    command = sidecar["command"]
    assert command[command.index("--admin-listen") + 1] == "$(POD_IP):9100"
    assert _env(sidecar)["POD_IP"] == {
        "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    running = {"metadata": pod["metadata"], "spec": pod["spec"],
               "status": {"podIP": "10.1.2.3"}}
    assert status_url(running) == "http://10.1.2.3:9100/kvquota/status"
    annotations = pod["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
        "9100", "/metrics")


def _admits(rule: dict[str, Any], namespace: str, labels: dict[str, str]) -> bool:
    """Whether one NetworkPolicy ingress rule admits a pod (no `from`: every pod)."""
    peers = rule.get("from")
    if peers is None:
        return True
    for peer in peers:
        ns = peer.get("namespaceSelector", {}).get("matchLabels")
        pods = peer.get("podSelector", {}).get("matchLabels", {})
        if ns is not None and ns != {"kubernetes.io/metadata.name": namespace}:
            continue
        if pods.items() <= labels.items():
            return True
    return False


def test_only_the_operator_and_prometheus_reach_the_admin_port() -> None:
    objects = build(EXAMPLE)
    pod = _pod(objects)
    policy = one(objects, "NetworkPolicy", "kvquota-engine")
    assert policy["metadata"]["namespace"] == "default"  # the engine's own
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        pod["metadata"]["labels"].items())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    operator = one(build("manifests/base"), "Deployment", "kvquota-operator")
    operator_ns = operator["metadata"]["namespace"]
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]

    def admitted(port: str, namespace: str, labels: dict[str, str]) -> bool:
        return any(_admits(rule, namespace, labels) for rule in policy["spec"]["ingress"]
                   if port in {p["port"] for p in rule["ports"]})

    client = ("default", {"app": "some-client"})
    assert admitted("http", *client) and not admitted("admin", *client)
    assert admitted("admin", operator_ns, operator_labels)
    assert not admitted("admin", operator_ns, {"app": "something-else"})
    assert admitted("admin", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    named = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} <= named


def test_added_containers_run_unprivileged() -> None:
    pod = _pod(build(EXAMPLE))
    for container in (*pod["spec"]["initContainers"], _container(pod, "kvquota-sidecar")):
        context = container["securityContext"]
        assert context["runAsNonRoot"] and context["readOnlyRootFilesystem"]
        assert context["capabilities"]["drop"] == ["ALL"]
        assert context["allowPrivilegeEscalation"] is False


def test_the_engine_service_account_can_read_configmaps_of_its_namespace_only() -> None:
    objects = build(EXAMPLE)
    account = _pod(objects)["spec"]["serviceAccountName"]
    binding = one(objects, "RoleBinding", "kvquota-engine")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "default"}
    ]
    role = one(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}
    ]


def _deployment(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, "kvquota.dev/pool": "p"}},
                "spec": {"containers": [{"name": "vllm", "image": "x", "args": ["m"]}]},
            },
        },
    }


def test_component_patches_labelled_deployments_only(tmp_path: Path) -> None:
    web = _deployment("web", {})
    engine = _deployment("engine", {"kvquota.dev/engine": "true"})
    (tmp_path / "apps.yaml").write_text(yaml.safe_dump_all([web, engine]))
    component = os.path.relpath(MANIFESTS / "components" / "engine-sidecar", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "apps",
        "resources": ["apps.yaml"],
        "components": [component],
    }))
    objects = build(tmp_path)
    assert _pod(objects, "web", admitted=False)["spec"] == web["spec"]["template"]["spec"]
    patched = _pod(objects, "engine", admitted=False)
    assert {c["name"] for c in patched["spec"]["containers"]} == {"vllm", "kvquota-sidecar"}
    assert _container(patched, "vllm")["args"][0] == "m"
    # Scraped by the engines' PodMonitor even though the template did not carry the label.
    assert patched["metadata"]["labels"]["kvquota.dev/engine"] == "true"
