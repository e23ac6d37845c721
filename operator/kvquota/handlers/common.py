"""Helpers shared by the per-kind handler modules."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from engine_sidecar.contract.names import GROUP, VERSION

BACKOFF = 5.0  # seconds before kopf retries a failed handler
KEPT_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion",
                 "creationTimestamp", "deletionTimestamp")

__all__ = ["BACKOFF", "GROUP", "VERSION", "deleted", "retrying", "snapshot"]


def deleted(type: str, **_: Any) -> bool:
    """`when=` filter of event handlers: only the final DELETED event (kopf then skips
    the call, and its log line, for the thousands of other events)."""
    return type == "DELETED"


def snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an index keeps of an object: identity, spec and status (no managedFields
    or annotations, which include kopf's copy of the spec). The index functions that
    call it are `async`: kopf runs a plain function in a thread, a hop per event."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: copy.deepcopy(meta[k]) for k in KEPT_METADATA if k in meta},
        "spec": copy.deepcopy(dict(body.get("spec") or {})),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


async def retrying(
    action: Callable[[], Awaitable[None]], logger: logging.Logger | Any, attempts: int = 5
) -> None:
    """For event handlers, whose failures kopf only logs: retry a few times with backoff."""
    for attempt in range(attempts):
        try:
            await action()
            return
        except Exception:
            if attempt == attempts - 1:
                raise
            logger.warning("reconcile failed, retrying", exc_info=True)
            await asyncio.sleep(min(2**attempt, BACKOFF))
