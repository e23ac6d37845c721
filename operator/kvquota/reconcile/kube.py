"""The few Kubernetes API calls the operator makes beyond what kopf does for it.

kopf watches our CRs and patches the object a handler runs for; the reconciler also
writes ConfigMaps, other objects' status and lists engine pods. Those go through the
official (synchronous) client in worker threads, returning plain JSON dicts: no
model classes, one place for timeouts and 404 handling, easy to fake in tests.
"""

from __future__ import annotations

import asyncio
import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.names import GROUP, VERSION
from kvquota import __version__

if TYPE_CHECKING:
    import kubernetes.client

GATEWAY_POOL_APIS = (
    ("inference.networking.k8s.io", "v1"),
    ("inference.networking.x-k8s.io", "v1alpha2"),
)


CONNECTIONS = 32  # kept-alive connections to the API server

# Who the operator's writes are from, in managedFields and in conflict messages. Each of
# our writes passes it; and the API server names the manager of a write that passes
# none (kopf's own patches, events and peering keep-alives) after its User-Agent up to
# the first "/", so every client of the operator sends USER_AGENT.
FIELD_MANAGER = "kvquota-operator"
USER_AGENT = f"{FIELD_MANAGER}/{__version__}"


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    read: float = 30.0


def api_client(server: str | None) -> kubernetes.client.ApiClient:
    """An API client: in-cluster service account, else kubeconfig; or, when `server`
    is given (embedding, tests, benchmark), that URL without credentials."""
    import kubernetes.client
    import kubernetes.config

    if server:
        configuration = kubernetes.client.Configuration()
        configuration.host = server
        configuration.verify_ssl = False
    else:
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        configuration = kubernetes.client.Configuration.get_default_copy()
    # The client's default (5 per CPU: 10 on 2 cores) is below the status writes in
    # flight during a fan-out; urllib3 then discards and reconnects ("pool is full").
    configuration.connection_pool_maxsize = CONNECTIONS
    client = kubernetes.client.ApiClient(configuration)
    client.user_agent = USER_AGENT
    return client


PEERING_GROUP = "kopf.dev"  # kopf's peering CRDs (crds/kopf.dev_*kopfpeerings.yaml)
PEERING_VERSION = "v1"


class PeeringSetup(enum.Enum):
    """What creating the peering object found."""

    READY = "ready"  # created, or there already
    CRD_MISSING = "crd-missing"  # kopf's peering CRD is not installed
    FORBIDDEN = "forbidden"  # RBAC refuses the operator's account


def peering_crd(namespace: str | None) -> str:
    """The CRD kopf meets its peers in: cluster-wide, or in watched namespaces."""
    plural = "kopfpeerings" if namespace else "clusterkopfpeerings"
    return f"{plural}.{PEERING_GROUP}"


class KubeApi:
    """Async facade over the sync client; every call is bounded by `timeouts`."""

    def __init__(self, client: kubernetes.client.ApiClient, timeouts: Timeouts) -> None:
        import kubernetes.client

        self._core = kubernetes.client.CoreV1Api(client)
        self._custom = kubernetes.client.CustomObjectsApi(client)
        self._timeout = (timeouts.connect, timeouts.read)
        self._exception: type[Exception] = kubernetes.client.ApiException

    async def _call(self, fn: Any, *args: Any, parse: bool = True, **kwargs: Any) -> Any:
        """`fn` in a thread; the response parsed unless `parse` is False (a write of a
        large object whose echo nobody reads)."""
        kwargs.update(_request_timeout=self._timeout, _preload_content=False)
        response = await asyncio.to_thread(fn, *args, **kwargs)
        return json.loads(response.data) if parse and response.data else None

    def _is_missing(self, error: Exception) -> bool:
        return isinstance(error, self._exception) and getattr(error, "status", None) == 404

    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call(
                self._core.read_namespaced_config_map, name, namespace
            )
        except Exception as error:
            if self._is_missing(error):
                return None
            raise
        return result

    async def create_configmap(self, body: dict[str, Any]) -> None:
        await self._call(
            self._core.create_namespaced_config_map, body["metadata"]["namespace"], body,
            field_manager=FIELD_MANAGER, parse=False,
        )

    async def patch_configmap(self, namespace: str, name: str, patch: dict[str, Any]) -> bool:
        """Strategic-merge-patch a ConfigMap; False when it does not exist."""
        try:
            await self._call(self._core.patch_namespaced_config_map, name, namespace, patch,
                             field_manager=FIELD_MANAGER, parse=False)
        except Exception as error:
            if self._is_missing(error):
                return False
            raise
        return True

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = await self._call(
            self._core.list_namespaced_pod, namespace, label_selector=label_selector
        )
        return list((result or {}).get("items") or [])

    async def patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any]
    ) -> bool:
        """Merge-patch `.status` of one of our objects; False when it is gone."""
        try:
            await self._call(
                self._custom.patch_namespaced_custom_object_status,
                GROUP, VERSION, namespace, plural, name, {"status": status},
                field_manager=FIELD_MANAGER,
                parse=False,  # the echo is the whole object; the watch brings it anyway
            )
        except Exception as error:
            if self._is_missing(error):
                return False
            raise
        return True

    async def get_gateway_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Gateway API Inference Extension InferencePool (GA group first)."""
        for group, version in GATEWAY_POOL_APIS:
            try:
                result: dict[str, Any] = await self._call(
                    self._custom.get_namespaced_custom_object,
                    group, version, namespace, "inferencepools", name,
                )
            except Exception as error:
                if self._is_missing(error):
                    continue
                raise
            return result
        return None

    async def ensure_peering(self, name: str, namespace: str | None = None) -> PeeringSetup:
        """Create kopf's peering object `name` unless it exists: a ClusterKopfPeering, or
        with `namespace` a KopfPeering there."""
        plural = peering_crd(namespace).split(".", 1)[0]
        body: dict[str, Any] = {
            "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}",
            "kind": "KopfPeering" if namespace else "ClusterKopfPeering",
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
        }
        try:
            if namespace:
                await self._call(self._custom.create_namespaced_custom_object, PEERING_GROUP,
                                 PEERING_VERSION, namespace, plural, body,
                                 field_manager=FIELD_MANAGER)
            else:
                await self._call(self._custom.create_cluster_custom_object, PEERING_GROUP,
                                 PEERING_VERSION, plural, body, field_manager=FIELD_MANAGER)
        except Exception as error:
            status = getattr(error, "status", None) if isinstance(error, self._exception) else None
            if status == 409:
                return PeeringSetup.READY
            if status == 404:
                return PeeringSetup.CRD_MISSING
            if status == 403:
                return PeeringSetup.FORBIDDEN
            raise
        return PeeringSetup.READY
