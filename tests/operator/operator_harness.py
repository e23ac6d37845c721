"""Test-side helpers around the emulator: `Cluster` (plain HTTP, as kubectl would use
it) and `FakeEngines` (sidecar status servers plus the engine pods that point at them).
The fixtures in conftest.py hand these out; tests never touch KMock directly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import aiohttp.test_utils
import aiohttp.web

from engine_sidecar.contract.names import POLICY_FILE, STATUS_ROUTE
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import SidecarStatus
from kvquota.reconcile.configmap import configmap_name
from kvquota_lab.emulator import ApiServer

T = TypeVar("T")
# Seconds any single wait may take before the test fails. A wait ends as soon as its
# condition holds; the bound only decides when to give up. 10 s was too tight with two
# suites and two vLLM engines sharing 2 cores (a ConfigMap garbage-collected late).
WAIT = 60.0
PATHS = {
    "InferencePool": "/apis/kvquota.dev/v1alpha1/namespaces/{ns}/inferencepools",
    "TenantQuota": "/apis/kvquota.dev/v1alpha1/namespaces/{ns}/tenantquotas",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Event": "/api/v1/namespaces/{ns}/events",
    "GatewayInferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
}
PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"
NAMESPACED_PEERINGS = "/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings"


@dataclass
class Cluster:
    """Plain-HTTP access to the emulator, as kubectl would use it."""

    server: ApiServer
    url: str
    session: aiohttp.ClientSession

    def _path(self, kind: str, namespace: str, name: str | None = None, sub: str = "") -> str:
        path = self.url + PATHS[kind].format(ns=namespace)
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def _json(self, response: aiohttp.ClientResponse) -> dict[str, Any]:
        body: dict[str, Any] = await response.json()
        if response.status >= 400:
            raise AssertionError(f"{response.status}: {body.get('message')}")
        return body

    async def create(self, body: dict[str, Any], *, kind: str | None = None) -> dict[str, Any]:
        """POST `body`; `kind` picks the collection when the body's kind is ambiguous."""
        ns = body["metadata"].get("namespace", "default")
        async with self.session.post(self._path(kind or body["kind"], ns), json=body) as response:
            return await self._json(response)

    def install_gateway_api(self) -> None:
        """Serve `inferencepools.inference.networking.k8s.io` (as if its CRD were installed)."""
        from kmock import ResourceInfo

        self.server.resources["inference.networking.k8s.io/v1/inferencepools"] = ResourceInfo(
            kind="InferencePool", singular="inferencepool", namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"})

    def install_peering_crd(self, *, namespaced: bool = False) -> None:
        """Serve kopf's ClusterKopfPeering, or its namespaced KopfPeering (as
        crds/kopf.dev_*kopfpeerings.yaml declare them: status a plain field, no
        subresource)."""
        from kmock import ResourceInfo

        kind = "KopfPeering" if namespaced else "ClusterKopfPeering"
        self.server.resources[f"kopf.dev/v1/{kind.lower()}s"] = ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "patch", "delete"})

    async def peers(self, name: str, *, namespace: str | None = None) -> dict[str, Any]:
        """The peering object's status: kopf identity -> priority, lifetime, lastseen
        (a KopfPeering in `namespace`, else the ClusterKopfPeering)."""
        path = NAMESPACED_PEERINGS.format(ns=namespace) if namespace else PEERINGS
        async with self.session.get(f"{self.url}{path}/{name}") as response:
            return dict((await self._json(response)).get("status") or {})

    async def patch(self, kind: str, name: str, patch: dict[str, Any], *,
                    namespace: str = "default", sub: str = "") -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.session.patch(self._path(kind, namespace, name, sub), json=patch,
                                      headers=headers) as response:
            return await self._json(response)

    async def delete(self, kind: str, name: str, *, namespace: str = "default") -> None:
        async with self.session.delete(self._path(kind, namespace, name)) as response:
            await self._json(response)

    async def get(self, kind: str, name: str, *, namespace: str = "default"
                  ) -> dict[str, Any] | None:
        async with self.session.get(self._path(kind, namespace, name)) as response:
            if response.status == 404:
                return None
            return await self._json(response)

    async def list(self, kind: str, *, namespace: str = "default") -> list[dict[str, Any]]:
        async with self.session.get(self._path(kind, namespace)) as response:
            return list((await self._json(response))["items"])

    async def policy(self, pool: str, *, namespace: str = "default") -> EnginePolicy | None:
        cm = await self.get("ConfigMap", configmap_name(pool), namespace=namespace)
        return EnginePolicy.from_json(cm["data"][POLICY_FILE]) if cm else None

    async def wait_for(self, probe: Callable[[], Awaitable[T | None]], what: str,
                       timeout: float = WAIT) -> T:
        """Poll `probe` until it returns something truthy (bounded by `timeout`)."""
        deadline = asyncio.get_running_loop().time() + timeout
        last: T | None = None
        while asyncio.get_running_loop().time() < deadline:
            last = await probe()
            if last:
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")

    async def wait_status(self, kind: str, name: str, check: Callable[[dict[str, Any]], bool],
                          what: str, *, namespace: str = "default") -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            obj = await self.get(kind, name, namespace=namespace)
            return obj if obj is not None and check(obj) else None

        return await self.wait_for(probe, f"{kind} {name}: {what}")


@dataclass
class ManualClock:
    """The operator's disruption-window clock, moved only by the test: windows open and
    expire when the test says, not when a loaded machine gets round to it."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeEngine:
    """A sidecar status endpoint. With `follow` it reports the policy version found in
    the pool's ConfigMap (as a sidecar that hot-loads it would); else `version`."""

    name: str
    status: SidecarStatus
    follow: bool = True
    version: str | None = None
    server: aiohttp.test_utils.TestServer | None = None
    polls: int = 0  # status requests answered: the operator's poll rounds, as seen here

    def report(self, tenant_id: str, **tenant_status: Any) -> None:
        """Set what this engine reports for one tenant (SidecarStatus JSON fields)."""
        data = self.status.model_dump(by_alias=True)
        data["tenants"][tenant_id] = tenant_status
        self.status = SidecarStatus.model_validate(data)


@dataclass
class FakeEngines:
    cluster: Cluster
    pool: str = "demo-pool"
    labels: dict[str, str] = field(default_factory=lambda: {
        "app": "vllm", "kvquota.dev/pool": "demo-pool"})
    engines: dict[str, FakeEngine] = field(default_factory=dict)

    async def _current_version(self) -> str | None:
        policy = await self.cluster.policy(self.pool)
        return policy.version if policy else None

    async def add(self, name: str, *, total_blocks: int = 1000, follow: bool = True,
                  ready: bool = True) -> FakeEngine:
        engine = FakeEngine(name, SidecarStatus(ready=True, total_blocks=total_blocks,
                                                free_blocks=total_blocks), follow)

        async def serve(_: aiohttp.web.Request) -> aiohttp.web.Response:
            engine.polls += 1
            version = await self._current_version() if engine.follow else engine.version
            body = engine.status.model_copy(update={"policy_version": version})
            return aiohttp.web.json_response(body.model_dump(mode="json", by_alias=True))

        app = aiohttp.web.Application()
        app.router.add_get(STATUS_ROUTE, serve)
        engine.server = aiohttp.test_utils.TestServer(app, host="127.0.0.1")
        await engine.server.start_server()
        self.engines[name] = engine
        await self.cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": self.labels},
            "spec": {"containers": [{"name": "kvquota-sidecar", "image": "sidecar",
                                     "ports": [{"name": "admin",
                                                "containerPort": engine.server.port}]}]},
        })
        await self.cluster.patch("Pod", name, {"status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }}, sub="status")
        return engine

    async def close(self) -> None:
        for engine in self.engines.values():
            if engine.server is not None:
                await engine.server.close()
