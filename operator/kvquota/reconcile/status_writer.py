"""Status writes and Events: patch an object's status only where it changes, and
remember what was written until the watch shows it.

The index lags our own writes, so the last write stands in for the status an index
body still lacks (keyed by resourceVersion). A status built from the same inputs and
the same old status as last time is not built again: an edit to one quota rebuilds
one status, not every status of the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvquota.reconcile.status import event_worthy, status_patch

if TYPE_CHECKING:
    from kvquota.reconcile.kube import KubeApi

logger = logging.getLogger(__name__)

Ident = tuple[str, str, str]  # (plural, namespace, name)


@dataclass(frozen=True)
class PendingStatus:
    """A status patch to send: `new` built from `old`, as of `version`."""

    ident: Ident
    kind: str
    body: Mapping[str, Any]
    version: str | None
    old: Mapping[str, Any]
    new: dict[str, Any]
    patch: dict[str, Any]


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event through kopf's poster (outside kopf, e.g. in unit use: no-op)."""
    import kopf

    try:
        target = kopf.Body(cast("kopf.RawBody", dict(body)))
        kopf.event(target, type=type_, reason=reason, message=message[:1024])
    except LookupError:
        logger.debug("no kopf context to post %s/%s", type_, reason)


class StatusWriter:
    def __init__(self, kube: KubeApi) -> None:
        self._kube = kube
        # What we last wrote per object, until the watch shows it (keyed by resourceVersion).
        self._written: dict[Ident, tuple[str | None, dict[str, Any]]] = {}
        # Per status: the inputs and old status it was last built from. The same again
        # builds the same status, so it is skipped (an edit rebuilds one, not 1,000).
        self._built: dict[Ident, tuple[Any, ...]] = {}

    def forget(self, ident: Ident) -> None:
        self._written.pop(ident, None)
        self._built.pop(ident, None)

    def holds(self, ident: Ident) -> bool:
        """Whether anything about the object is still kept (tests of forgetting)."""
        return ident in self._written or ident in self._built

    async def write(
        self, plural: str, kind: str, body: Mapping[str, Any], owned: tuple[str, ...],
        build: Callable[..., dict[str, Any]],
    ) -> None:
        pending = self.prepare(plural, kind, body, owned, build)
        if pending is not None:
            await self.send(pending)

    async def send_all(self, pending: Iterable[PendingStatus], concurrency: int) -> None:
        """Send the patches, at most `concurrency` at a time."""
        limit = asyncio.Semaphore(concurrency)

        async def send(write: PendingStatus) -> None:
            async with limit:
                await self.send(write)

        await asyncio.gather(*(send(write) for write in pending))

    def prepare(
        self, plural: str, kind: str, body: Mapping[str, Any], owned: tuple[str, ...],
        build: Callable[..., dict[str, Any]], inputs: tuple[Any, ...] | None = None,
    ) -> PendingStatus | None:
        """The patch `build(old=...)` makes of the status, or None when it changes
        nothing. With `inputs` (everything `build` reads besides `old` and the clock),
        a status built from the same inputs and the same old status as last time is
        not built again."""
        meta: Mapping[str, Any] = body.get("metadata") or {}
        ident = (plural, str(meta.get("namespace")), str(meta.get("name")))
        version = meta.get("resourceVersion")
        remembered = self._written.get(ident)
        old: Mapping[str, Any] = body.get("status") or {}
        if remembered is not None:
            if remembered[0] == version:
                old = remembered[1]  # our last write is not in the watch yet
            else:
                del self._written[ident]
        stamp = None if inputs is None else (*inputs, version, remembered is not None
                                             and remembered[0] == version)
        if stamp is not None and self._built.get(ident) == stamp:
            return None
        new = build(old=old)
        patch = status_patch(old, new, owned)
        if patch is None:
            if stamp is not None:
                self._built[ident] = stamp  # up to date: skip until something changes
            return None
        # Not stamped until sent: a patch that fails is built and sent again next time.
        return PendingStatus(ident, kind, body, version, old, new, patch)

    async def send(self, write: PendingStatus) -> None:
        plural, namespace, name = write.ident
        if not await self._kube.patch_status(plural, namespace, name, write.patch):
            return  # deleted meanwhile
        old = write.old
        merged = {k: v for k, v in {**old, **write.patch}.items() if v is not None}
        self._written[write.ident] = (write.version, merged)
        self._built.pop(write.ident, None)  # stamped against an older status: void
        for type_, reason, message in event_worthy(write.kind, old, write.new):
            post_event(write.body, type_, reason, message)
