"""Where policies come from: a polled file, or the pool's ConfigMap watched in-cluster.

Both feed raw documents into a PolicyHolder; neither decides what is valid. Each runs
as one asyncio task that the app starts in its lifespan and cancels on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from engine_sidecar.contract import files
from engine_sidecar.contract.names import POLICY_FILE
from engine_sidecar.gateway.policy.active import PolicyHolder

logger = logging.getLogger(__name__)



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
        self._watch = files.FileWatch(path)

    def poll(self, holder: PolicyHolder) -> None:
        """One check: offer the file to the holder if it changed."""
        try:
            changed = self._watch.look()
        except OSError:
            changed = True
        if self._watch.signature is None:
            holder.report(f"policy file {self.path} not found")
        elif changed:
            try:
                raw = self.path.read_bytes()
            except OSError as exc:
                self._watch.signature = None  # read it again next time
                holder.report(f"cannot read policy file {self.path}: {exc.strerror}")
                return
            holder.offer(raw, f"file {self.path.name}")
        holder.refresh_secrets()

    async def run(self, holder: PolicyHolder) -> None:
        while True:
            self.poll(holder)
            await asyncio.sleep(self.interval)


class ConfigMapPolicySource:
    """Watch one ConfigMap's `policy.json` through the Kubernetes API.

    The kubernetes client is synchronous, so a list+watch loop runs in a daemon thread
    and hands documents to the event loop. A 410 Gone, a server-side watch timeout or a
    dropped connection re-lists; errors back off up to 30 s. Stopping shuts the watch
    socket down, so the thread never outlives the app. `api_client_factory` is
    injectable for tests.
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        key: str = POLICY_FILE,
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
        self._response: Any = None

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
            response = self._response
            if response is not None:
                with contextlib.suppress(Exception):
                    response.shutdown()  # unblocks the thread's read at once

    def _handle(self, obj: dict[str, Any], post: Callable[[str, str], None]) -> None:
        data = obj.get("data") or {}
        if isinstance(data, dict) and isinstance(data.get(self.key), str):
            post("policy", data[self.key])
        else:
            post("error", f"{self.description}: the key is missing")

    def _is_ours(self, obj: Any) -> bool:
        metadata = obj.get("metadata") if isinstance(obj, dict) else None
        return isinstance(metadata, dict) and metadata.get("name") == self.name

    def _list(self, api: Any, post: Callable[[str, str], None]) -> str | None:
        response = api.list_namespaced_config_map(
            self.namespace, field_selector=f"metadata.name={self.name}",
            _preload_content=False, _request_timeout=(10, 30),
        )
        listing = json.loads(response.data)
        items = [i for i in listing.get("items") or [] if self._is_ours(i)]
        if items:
            self._handle(items[0], post)
        else:
            post("error", f"{self.description}: the ConfigMap does not exist")
        version = (listing.get("metadata") or {}).get("resourceVersion")
        return version if isinstance(version, str) else None

    def _watch(self, api: Any, version: str | None, post: Callable[[str, str], None]) -> None:
        response = api.list_namespaced_config_map(
            self.namespace, field_selector=f"metadata.name={self.name}", watch=True,
            resource_version=version, timeout_seconds=self._watch_timeout,
            allow_watch_bookmarks=False, _preload_content=False,
            _request_timeout=(10, self._watch_timeout + 30),
        )
        self._response = response
        try:
            if self._stop.is_set():  # stopped while connecting: run() saw no response
                return
            pending = b""
            for chunk in response.stream(amt=None, decode_content=True):
                if self._stop.is_set():
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line), post)
        finally:
            self._response = None
            response.release_conn()

    def _event(self, event: dict[str, Any], post: Callable[[str, str], None]) -> None:
        kind, obj = event.get("type"), event.get("object")
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            raise _WatchExpired() if code == 410 else RuntimeError(f"watch error {code}")
        if not self._is_ours(obj):
            return  # field selectors are advisory for some API servers
        assert isinstance(obj, dict)
        if kind in ("ADDED", "MODIFIED"):
            self._handle(obj, post)
        elif kind == "DELETED":
            post("error", f"{self.description}: the ConfigMap was deleted")

    def _watch_forever(self, post: Callable[[str, str], None]) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        backoff = 1.0
        api = client.CoreV1Api(self._api_client_factory())
        while not self._stop.is_set():
            try:
                version = self._list(api, post)
                self._watch(api, version, post)
                backoff = 1.0
            except _WatchExpired:
                continue  # our resourceVersion is too old: re-list at once
            except ApiException as exc:
                post("error", f"{self.description}: API error {exc.status} {exc.reason}")
            except Exception as exc:  # the watch must survive any transport hiccup
                if self._stop.is_set():
                    return
                logger.warning("policy watch of %s failed (%s); retrying",
                               self.description, type(exc).__name__)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)


class _WatchExpired(Exception):
    """410 Gone inside a watch stream."""


def _in_cluster_api_client() -> Any:
    from kubernetes import client, config

    config.load_incluster_config()
    return client.ApiClient()
