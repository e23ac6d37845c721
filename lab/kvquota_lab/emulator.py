"""An apiserver-like Kubernetes emulator (KMock) and an in-thread operator runner.

For the operator tests and `python -m kvquota_lab.bench_operator` only (needs the `test`
extra: kmock is pinned there, pre-1.0). KMock 0.8 keeps objects, serves discovery,
lists, watches and patches; `ApiServer` adds what kopf needs from a real API server
(see /work/shared/KMOCK.md): uid, creationTimestamp, generation and resourceVersion
bookkeeping, status subresource semantics, generateName, 422 for a failed JSON-patch
`test`, typed lists, ownerReference garbage collection, and 404 for a resource no CRD
declares. A test may deny resources (403, as RBAC would) and record who wrote what.
It still does not validate, default, prune, or honour label selectors.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import sys
import threading
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import dicts as kmock_dicts  # merge/JSON-patch exactly as KMock does

from kvquota.runtime import OperatorConfig

OUR_RESOURCES = {
    "kvquota.dev/v1alpha1/inferencepools": ("InferencePool", "inferencepool", {"kvpool"}),
    "kvquota.dev/v1alpha1/tenantquotas": ("TenantQuota", "tenantquota", {"tq"}),
}


@dataclass(frozen=True)
class Write:
    """One write request as the API server would attribute it."""

    action: str  # create, update (any PATCH or PUT) or delete
    resource: str  # plural[.group][/subresource]
    field_manager: str | None  # the `fieldManager` query parameter
    user_agent: str

    @property
    def manager(self) -> str:
        """The manager managedFields record: `fieldManager`, else the User-Agent up to
        its first "/" (prefixFromUserAgent, k8s.io/apiserver/pkg/endpoints/handlers)."""
        return self.field_manager or self.user_agent.split("/", 1)[0]


def _with_data(request: kmock.Request, data: Any) -> kmock.Request:
    """Replace the body KMock will store. In place: KMock matches its reactions by the
    identity of the request object it recorded, so a copy would match nothing."""
    object.__setattr__(request, "data", data)
    return request


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """KMock's emulator plus the apiserver bookkeeping kopf relies on."""

    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _created: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _epoch: datetime.datetime = attrs.field(
        factory=lambda: datetime.datetime.now(datetime.UTC).replace(microsecond=0), init=False
    )
    # (group, plural) every request for which is refused with 403, as RBAC would.
    forbidden: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    # Every write, when a test sets a list here (off by default: benchmarks write a lot).
    writes: list[Write] | None = attrs.field(default=None, init=False)

    def declare(self) -> None:
        """Built-in kinds plus our CRDs (with their status subresource)."""
        self.resources.load_bundled()
        for key, (kind, singular, short) in OUR_RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, singular=singular, namespaced=True, shortnames=short,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources={"status"},
            )

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as stored now (in-process, no HTTP), e.g. `("v1/configmaps", ...)`."""
        key: Any = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _stamp_create(self, request: kmock.Request) -> kmock.Request:
        data = copy.deepcopy(request.data or {})
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        # Creation times one second apart: distinct, in creation order, like a slow kubectl.
        created = self._epoch + datetime.timedelta(seconds=next(self._created))
        meta.update(uid=str(uuid.uuid4()), generation=1,
                    resourceVersion=str(next(self._versions)),
                    creationTimestamp=created.strftime("%Y-%m-%dT%H:%M:%SZ"))
        if self._has_status(request.resource):
            data.pop("status", None)
        return _with_data(request, data)

    def _stamp_update(self, request: kmock.Request, current: dict[str, Any]) -> kmock.Request:
        try:
            new = dict(kmock_dicts.patch_dict(copy.deepcopy(current), request.data or {}))
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(error)) from None
        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
        elif self._has_status(request.resource):
            new["status"] = current.get("status")
        new = {k: v for k, v in new.items() if v is not None}
        meta, old_meta = new.setdefault("metadata", {}), current.get("metadata") or {}
        for kept in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if kept in old_meta:
                meta[kept] = old_meta[kept]
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(old_meta.get("generation") or 0) + 1
        meta["resourceVersion"] = str(next(self._versions))
        return _with_data(request, [{"op": "replace", "path": "", "value": new}])

    def _forget(self, request: kmock.Request) -> None:
        """Drop a served request from KMock's records. KMock keeps every request for
        assertions and matches each new one against all of them, which turns quadratic
        (seconds per request) after a few thousand; we never assert on requests."""
        for records in (self._requests, *(getattr(p, "_requests", []) for p in self._payloads)):
            for i in range(len(records) - 1, -1, -1):
                if records[i] is request:
                    del records[i]
                    break

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        try:
            return await self._handle_recorded(request)
        finally:
            self._forget(request)

    def _refuse(self, request: kmock.Request) -> None:
        """404 for a resource no CRD declares (KMock would store it), 403 for a denied
        one; and the write recorded, if a test asked for that."""
        resource = request.resource
        if resource is None or not resource.plural:  # discovery, not a resource
            return
        group, plural = str(resource.group or ""), str(resource.plural)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE
                              ) and self.writes is not None:
            name = f"{plural}.{group}" if group else plural
            self.writes.append(Write(
                str(request.action.value).lower(),
                name + (f"/{request.subresource}" if request.subresource else ""),
                request.params.get("fieldManager"), request.headers.get("User-Agent", "")))
        if resource not in self.resources:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message="the server could not find the requested "
                                                "resource")
        if (group, plural) in self.forbidden:
            raise kmock.KubernetesError(
                status=403, reason="Forbidden",
                message=f"{plural}.{group} is forbidden: User \"system:serviceaccount:"
                        f"kvquota-system:kvquota-operator\" cannot {request.method} resource "
                        f"\"{plural}\" in API group \"{group}\"")

    async def _handle_recorded(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self._refuse(request)
        action = request.action
        if request.resource is None or action not in (
            kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE
        ):
            return await super()._handle(request)
        async with self._writes:
            key: Any = (request.resource, request.namespace, request.name)
            # ObjectsArray is not a Mapping: no .get().
            stored = self.objects[key] if key in self.objects else None  # noqa: SIM401
            alive = stored is not None and not stored.deleted
            if action == kmock.action.CREATE:
                request = self._stamp_create(request)
            elif action == kmock.action.UPDATE and alive:
                assert stored is not None
                request = self._stamp_update(request, stored.raw)
            elif action == kmock.action.DELETE and alive:
                assert stored is not None
                meta = stored.raw.get("metadata") or {}
                if meta.get("finalizers") and not meta.get("deletionTimestamp"):
                    stored["metadata"] = {**meta, "resourceVersion": str(next(self._versions))}
            uid = (stored.raw.get("metadata") or {}).get("uid") if alive and stored else None
            response = await super()._handle(request)
            if uid and stored is not None and stored.deleted:
                await self._collect_garbage(uid)
            return response

    async def _collect_garbage(self, owner_uid: str) -> None:
        """What the garbage collector does for dependents of a deleted owner."""
        for (resource, _namespace, _name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            owners = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == owner_uid for o in owners):
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})

    async def _serve_list(self, request: kmock.Request) -> Any:
        result: dict[str, Any] = dict(cast(Any, await super()._serve_list(request)))
        assert request.resource is not None
        kind = getattr(self.resources.get(request.resource), "kind", None) or "Unknown"
        group, version = request.resource.group, request.resource.version
        result["apiVersion"] = f"{group}/{version}" if group else str(version)
        result["kind"] = f"{kind}List"
        result["metadata"] = {"resourceVersion": str(next(self._versions))}
        return result


@contextlib.asynccontextmanager
async def serve() -> AsyncIterator[tuple[ApiServer, str]]:
    """A running emulator with our resources declared, and its base URL."""
    async with ApiServer() as server, kmock.Server(server) as http:
        server.declare()
        yield server, str(http.url).rstrip("/")


@dataclass
class OperatorRunner:
    """The real operator (all of kvquota.handlers) in its own thread and event loop,
    as KMOCK.md requires (kopf cancels every task created after it started when it
    exits). Start and stop any number of times."""

    config: OperatorConfig
    failure: BaseException | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _main: tuple[asyncio.AbstractEventLoop, asyncio.Task[None]] | None = None
    _memo: Any = None

    @property
    def reconciles(self) -> int:
        """Pool reconciles the running operator has started (0 before its startup
        handler). A reconcile of a pool finishes before the next one of it starts, so
        waiting for this to grow is a barrier, unlike sleeping."""
        runtime = getattr(self._memo, "runtime", None)
        return int(runtime.reconciler.reconciles) if runtime is not None else 0

    def _run(self, ready: threading.Event) -> None:
        import kopf

        import kvquota.handlers  # noqa: F401  (registers the handlers)

        async def main() -> None:
            task = asyncio.current_task()
            assert task is not None
            self._main = (asyncio.get_running_loop(), task)
            self._memo = kopf.Memo(config=self.config)
            await kopf.operator(
                clusterwide=True, standalone=True, memo=self._memo,
                stop_flag=self._stop, ready_flag=ready,
            )

        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass  # stop() cut kopf's grace period for lingering tasks short
        except BaseException as error:  # surfaced by stop()
            self.failure = error

    async def start(self, timeout: float = 10.0) -> None:
        ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not await asyncio.to_thread(ready.wait, timeout):
            raise RuntimeError("kopf did not become ready")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop like a terminated pod. kopf gives tasks spawned by late events 5 s to
        finish; after a second we cancel instead, to keep tests fast."""
        if self._thread is None:
            return
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 1.0)
        if self._thread.is_alive() and self._main is not None:
            loop, task = self._main
            loop.call_soon_threadsafe(task.cancel)
            await asyncio.to_thread(self._thread.join, timeout)
        thread, self._thread = self._thread, None
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident or 0)
            where = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
            raise RuntimeError(f"kopf did not stop; its thread is at:\n{where}")
        if self.failure is not None:
            raise RuntimeError(f"kopf failed: {self.failure!r}") from self.failure
