"""Where policies come from: a polled file, or the pool's ConfigMap watched in-cluster.

Both feed raw documents into a PolicyHolder; neither decides what is valid. Each runs
as one asyncio task that the app starts in its lifespan and cancels on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from engine_sidecar.gateway.active_policy import PolicyHolder

logger = logging.getLogger(__name__)

CONFIGMAP_KEY = "policy.json"


class PolicySource(Protocol):
    description: str

    async def run(self, holder: PolicyHolder) -> None:
        """Feed the holder until cancelled."""


class FilePolicySource:
    """Poll a file (mtime, size, inode); cheap, and works with atomic replaces and
    kubelet's symlink swaps of mounted ConfigMaps."""

    def __init__(self, path: Path, interval: float = 1.0) -> None:
        self.path = path
        self.interval = interval
        self.description = f"file {path}"

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self, holder: PolicyHolder, last: object) -> object:
        """One check; returns the signature to compare with next time."""
        signature = self._signature()
        if signature is None:
            holder.report(f"policy file {self.path} not found")
        elif signature != last:
            try:
                raw = self.path.read_bytes()
            except OSError as exc:
                holder.report(f"cannot read policy file {self.path}: {exc.strerror}")
                return None
            holder.offer(raw, f"file {self.path.name}")
        holder.refresh_secrets()
        return signature

    async def run(self, holder: PolicyHolder) -> None:
        last: object = None
        while True:
            last = self.poll(holder, last)
            await asyncio.sleep(self.interval)


class ConfigMapPolicySource:
    """Watch one ConfigMap's `policy.json` through the Kubernetes API.

    The kubernetes client is synchronous, so the list+watch loop runs in a daemon
    thread and hands documents to the event loop. A 410 Gone or a dropped watch
    re-lists; errors back off up to 30 s. `api_client` is injectable for tests.
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        key: str = CONFIGMAP_KEY,
        api_client_factory: Callable[[], Any] | None = None,
        watch_timeout_seconds: int = 300,
        secrets_interval: float = 2.0,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.key = key
        self.description = f"ConfigMap {namespace}/{name} key {key}"
        self._api_client_factory = api_client_factory or _in_cluster_api_client
        self._watch_timeout = watch_timeout_seconds
        self._secrets_interval = secrets_interval
        self._stop = threading.Event()

    async def run(self, holder: PolicyHolder) -> None:
        loop = asyncio.get_running_loop()

        def deliver(kind: str, payload: str) -> None:
            if kind == "policy":
                holder.offer(payload, f"ConfigMap {self.namespace}/{self.name}")
            else:
                holder.report(payload)

        def post(kind: str, payload: str) -> None:
            with contextlib.suppress(RuntimeError):  # loop closed during shutdown
                loop.call_soon_threadsafe(deliver, kind, payload)

        self._stop.clear()
        thread = threading.Thread(
            target=self._watch_forever, args=(post,), name="kvquota-policy-watch", daemon=True
        )
        thread.start()
        try:
            while True:
                await asyncio.sleep(self._secrets_interval)
                holder.refresh_secrets()
        finally:
            self._stop.set()

    def _handle(self, obj: Any, post: Callable[[str, str], None]) -> None:
        data = getattr(obj, "data", None) or {}
        if self.key in data:
            post("policy", data[self.key])
        else:
            post("error", f"{self.description}: the key is missing")

    def _watch_forever(self, post: Callable[[str, str], None]) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        backoff = 1.0
        api = client.CoreV1Api(self._api_client_factory())
        selector = f"metadata.name={self.name}"
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_config_map(self.namespace, field_selector=selector)
                items = [i for i in listing.items if i.metadata.name == self.name]
                if items:
                    self._handle(items[0], post)
                else:
                    post("error", f"{self.description}: the ConfigMap does not exist")
                stream = watch.Watch()
                for event in stream.stream(
                    api.list_namespaced_config_map, self.namespace, field_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=self._watch_timeout,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    obj = event["object"]
                    if getattr(obj.metadata, "name", None) != self.name:
                        continue  # field selectors are advisory for some API servers
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._handle(obj, post)
                    elif event["type"] == "DELETED":
                        post("error", f"{self.description}: the ConfigMap was deleted")
                backoff = 1.0
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: our resourceVersion is too old, re-list
                    post("error", f"{self.description}: API error {exc.status} {exc.reason}")
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            except Exception as exc:  # the watch must survive any transport hiccup
                logger.warning("policy watch of %s failed: %s", self.description,
                               type(exc).__name__)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


def _in_cluster_api_client() -> Any:
    from kubernetes import client, config

    config.load_incluster_config()
    return client.ApiClient()
