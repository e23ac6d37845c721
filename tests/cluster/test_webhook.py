"""The injection webhook on a real API server: the operator (a local process, its
self-signed CA published as the caBundle) mutates an engine Pod, and one its
ReplicaSet creates.

The API server must reach the local process. manifests/base's Service selects the
operator's pods, and none runs here, so the test points the webhook configuration at
a Service of its own for the duration: an ExternalName to this host's address, or,
where the API server resolves webhooks through endpoints, a Service without selector
and hand-written Endpoints and EndpointSlice. Override the address with
KVQUOTA_CLUSTER_TEST_WEBHOOK_ADDRESS (an IP or DNS name the API server can dial).
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from .conftest import (
    MANIFESTS,
    Cluster,
    Operator,
    deployed_flags,
    dump,
    free_port,
    wait_for,
)

CONFIGURATION = "kvquota-sidecar-injector"  # manifests/base/webhook.yaml
WEBHOOK = "inject.kvquota.dev"
SERVICE = "kvquota-webhook-test"
SIDECAR = "kvquota-sidecar"  # kvquota.inject.pod.SIDECAR
INJECTED = "kvquota.dev/injected"


def _source_address(host: str) -> str | None:
    """The local address a packet to `host` leaves from (no packet is sent)."""
    try:
        target = socket.getaddrinfo(host, 443, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            return str(sock.getsockname()[0])
    except OSError:
        return None


def _addresses(cluster: Cluster) -> tuple[str, str | None]:
    """(an address the API server can dial, a non-loopback one for Endpoints or None)."""
    server = cluster.kubectl.run("config", "view", "--minify", "-o",
                                 "jsonpath={.clusters[0].cluster.server}").stdout
    override = os.environ.get("KVQUOTA_CLUSTER_TEST_WEBHOOK_ADDRESS")
    near = override or _source_address(urlparse(server).hostname or "127.0.0.1") or "127.0.0.1"
    routable = [a for a in (near, _source_address("10.255.255.255"))
                if a and _is_ip(a) and not ipaddress.ip_address(a).is_loopback]
    return near, routable[0] if routable else None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _engine(namespace: str) -> dict[str, Any]:
    """The gpu-engine example's Deployment (stock vLLM, labelled for the demo pool)."""
    objects = MANIFESTS / "examples" / "gpu-engine" / "engine.yaml"
    (deployment,) = [d for d in yaml.safe_load_all(objects.read_text())
                     if d and d["kind"] == "Deployment"]
    deployment["metadata"]["namespace"] = namespace
    return dict(deployment)


def _pod(namespace: str, name: str) -> dict[str, Any]:
    template = copy.deepcopy(_engine(namespace)["spec"]["template"])
    template["metadata"].update(name=name, namespace=namespace)
    return {"apiVersion": "v1", "kind": "Pod", **template}


def _injected(pod: dict[str, Any] | None) -> bool:
    names = [c["name"] for c in ((pod or {}).get("spec") or {}).get("containers") or []]
    return SIDECAR in names and INJECTED in ((pod or {}).get("metadata") or {}).get(
        "annotations", {})


class Route:
    """Where the webhook configuration sends the API server, for the test's duration."""

    def __init__(self, cluster: Cluster, namespace: str, port: int) -> None:
        self.kubectl, self.namespace, self.port = cluster.kubectl, namespace, port
        config = self.kubectl.get("mutatingwebhookconfiguration", CONFIGURATION)
        names = [w["name"] for w in config["webhooks"]]
        self.index = names.index(WEBHOOK)
        self.original = config["webhooks"][self.index]["clientConfig"]["service"]

    def _point(self, service: dict[str, Any]) -> None:
        patch = [{"op": "test", "path": f"/webhooks/{self.index}/name", "value": WEBHOOK},
                 {"op": "replace", "path": f"/webhooks/{self.index}/clientConfig/service",
                  "value": service}]
        self.kubectl.run("patch", "mutatingwebhookconfiguration", CONFIGURATION,
                         "--type=json", "-p", json.dumps(patch))

    def _replace_service(self, spec: dict[str, Any]) -> None:
        self.kubectl.run("delete", "service", SERVICE, "-n", self.namespace,
                         "--ignore-not-found")
        self.kubectl.apply([{"apiVersion": "v1", "kind": "Service",
                             "metadata": {"name": SERVICE, "namespace": self.namespace},
                             "spec": spec}])

    def external_name(self, address: str) -> None:
        """ExternalName: the API server's default (ClusterIP) resolver dials
        `address:port` and checks the certificate against the Service's DNS name."""
        self._replace_service({"type": "ExternalName", "externalName": address})
        self._point({"namespace": self.namespace, "name": SERVICE, "port": self.port,
                     "path": self.original.get("path", "/inject-sidecar")})

    def endpoints(self, address: str) -> None:
        """A Service without selector, its Endpoints and EndpointSlice written here:
        for API servers that resolve webhooks through endpoints (and kube-proxy)."""
        self._replace_service({"ports": [{"name": "https", "port": 443,
                                          "targetPort": self.port}]})
        port = {"name": "https", "port": self.port, "protocol": "TCP"}
        self.kubectl.apply([
            {"apiVersion": "v1", "kind": "Endpoints",
             "metadata": {"name": SERVICE, "namespace": self.namespace},
             "subsets": [{"addresses": [{"ip": address}], "ports": [port]}]},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"{SERVICE}-local", "namespace": self.namespace,
                          "labels": {"kubernetes.io/service-name": SERVICE,
                                     "endpointslice.kubernetes.io/managed-by":
                                         "kvquota-cluster-test"}},
             "addressType": "IPv6" if ":" in address else "IPv4",
             "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
             "ports": [port]},
        ])
        self._point({"namespace": self.namespace, "name": SERVICE, "port": 443,
                     "path": self.original.get("path", "/inject-sidecar")})

    def restore(self) -> None:
        self._point(self.original)


@pytest.fixture
def webhook(installed: Cluster, new_namespace: Callable[[str], str],
            run_operator: Callable[..., Operator]) -> Iterator[tuple[str, Operator]]:
    """The operator serving the webhook, and the API server calling it; yields the
    namespace to create engines in."""
    installed.require("pods", "services", "replicasets.apps")
    ns = new_namespace("webhook")
    port = free_port()
    near, routable = _addresses(installed)
    route = Route(installed, ns, port)
    before = installed.kubectl.get("mutatingwebhookconfiguration", CONFIGURATION)
    old_bundle = before["webhooks"][route.index]["clientConfig"].get("caBundle")
    operator = run_operator("webhook", *deployed_flags(), "--webhook-listen",
                            f"0.0.0.0:{port}", "--webhook-service", f"{SERVICE}.{ns}")
    try:
        wait_for(lambda: installed.kubectl.get("mutatingwebhookconfiguration", CONFIGURATION),
                 lambda c: c["webhooks"][route.index]["clientConfig"].get("caBundle") not in (
                     None, old_bundle), "the operator to publish its CA as caBundle")
        tried = []
        modes: list[tuple[str, Callable[[str], None], str | None]] = [
            ("ExternalName", route.external_name, near)]
        if installed.serves("endpoints") or installed.serves(
                "endpointslices.discovery.k8s.io"):
            modes.append(("Endpoints", route.endpoints, routable))
        for mode, point, address in modes:
            if address is None:
                tried.append(f"{mode}: no non-loopback address on this host")
                continue
            try:
                point(address)
                wait_for(lambda: _dry_run(installed, ns), lambda r: r[0],
                         f"the API server to call the webhook ({mode} to {address}:{port})",
                         timeout=30, interval=1)
            except AssertionError as error:
                tried.append(f"{mode} to {address}: {error}")
                continue
            print(f"webhook reached through a {mode} Service to {address}:{port}")
            break
        else:
            pytest.fail("the API server never reached the local webhook:\n" + "\n".join(
                tried) + f"\nlog:\n{operator.output()}")
        yield ns, operator
    finally:
        route.restore()


def _dry_run(cluster: Cluster, ns: str) -> tuple[bool, str]:
    proc = cluster.kubectl.run("create", "--dry-run=server", "-o", "json", "-f", "-",
                               stdin=json.dumps(_pod(ns, "probe")), check=False)
    if proc.returncode:
        return False, proc.stderr
    return _injected(json.loads(proc.stdout)), proc.stdout[:2000]


def test_webhook_injects_a_pod(installed: Cluster, webhook: tuple[str, Operator]) -> None:
    ns, operator = webhook
    proc = installed.kubectl.run("create", "-o", "json", "-f", "-",
                                 stdin=json.dumps(_pod(ns, "engine-0")))
    created = json.loads(proc.stdout)
    assert _injected(created), f"{dump(created)}\nlog:\n{operator.output()}"
    live = installed.kubectl.get("pod", "engine-0", ns)
    assert _injected(live), dump(live)
    installed.kubectl.run("delete", "pod", "engine-0", "-n", ns, "--wait=false")


def test_webhook_injects_a_pod_its_replicaset_creates(
    installed: Cluster, webhook: tuple[str, Operator]
) -> None:
    ns, operator = webhook
    engine = _engine(ns)
    replicaset = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                  "metadata": {"name": "vllm-engine", "namespace": ns},
                  "spec": {"replicas": 1, "selector": engine["spec"]["selector"],
                           "template": engine["spec"]["template"]}}
    installed.kubectl.apply([replicaset])
    selector = "-l" + ",".join(f"{k}={v}" for k, v in
                               engine["spec"]["selector"]["matchLabels"].items())
    try:
        pods = wait_for(lambda: installed.kubectl.items("pods", ns, selector), bool,
                        "the ReplicaSet's Pod", timeout=45, interval=1)
    except AssertionError as error:
        if installed.controller_manager():
            events = installed.kubectl.run("get", "events", "-n", ns).stdout
            raise AssertionError(f"{error}\nevents:\n{events}\nlog:\n{operator.output()}"
                                 ) from None
        pytest.skip("no Pod from the ReplicaSet within 45 s, and no kube-controller-manager "
                    "holds its lease here: nothing creates ReplicaSets' Pods")
    (pod,) = pods
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet", dump(pod)
    assert _injected(pod), dump(pod)
    installed.kubectl.run("delete", "replicaset", "vllm-engine", "-n", ns, "--wait=false")
