"""InferencePool handlers: index pools, reconcile on change, poll engines in a daemon.

No finalizer: a pool has nothing to clean up. Its ConfigMap goes with it (an
ownerReference, the garbage collector), its quotas learn PoolNotFound from the DELETED
event, and the engine-poll daemon ends itself within a tick once the pool leaves the
index. So deleting a pool never waits for the operator, and pools that still carry
`kvquota.dev/finalizer` from older releases lose it at their next event (kopf removes
its finalizer from objects no handler needs it on).
"""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import kopf

from kvquota.handlers.common import (
    BACKOFF,
    GROUP,
    VERSION,
    deleted,
    retrying,
    runtime_of,
    snapshot,
)
from kvquota.metrics import timed_reconcile
from kvquota.reconcile.reconciler import POOLS, PoolKey

KIND = "InferencePool"
TICK_SECONDS = 0.5  # daemon resolution; the poll interval itself is OperatorConfig's
STOP_SECONDS = 5.0  # on exit or pause kopf cancels the daemon, then waits this long


@kopf.index(GROUP, VERSION, POOLS)
async def inferencepools_by_key(
    namespace: str, name: str, body: kopf.Body, **_: Any
) -> dict[PoolKey, dict[str, Any]]:
    return {(namespace, name): snapshot(body)}


@kopf.on.resume(GROUP, VERSION, POOLS, backoff=BACKOFF)
@kopf.on.create(GROUP, VERSION, POOLS, backoff=BACKOFF)
@kopf.on.update(GROUP, VERSION, POOLS, backoff=BACKOFF)
async def pool_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A new or edited pool (maybe a new selector): look at its engines right away."""
    with timed_reconcile(KIND):
        await runtime_of(memo).reconciler.poll((namespace, name), since=time.monotonic())


@kopf.on.event(GROUP, VERSION, POOLS, when=deleted)
async def pool_deleted(
    namespace: str, name: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """A deleted pool leaves its quotas with PoolNotFound."""
    seen = time.monotonic()
    reconciler = runtime_of(memo).reconciler
    reconciler.forget(POOLS, namespace, name)
    with timed_reconcile(KIND):
        await retrying(lambda: reconciler.reconcile((namespace, name), since=seen), logger)


def _stops_itself(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register `fn` as a daemon that puts no finalizer on its objects.

    kopf gives every daemon and timer a finalizer, so that it can stop them before
    their object goes, and offers no option against it. This daemon needs none: it
    returns once its pool (by uid) leaves the index, which the DELETED event does.
    """
    spawning = kopf.get_default_registry()._spawning  # no public way to say so
    spawning._handlers = [
        dataclasses.replace(handler, requires_finalizer=False) if handler.fn is fn else handler
        for handler in spawning._handlers
    ]
    return fn


def _indexed(index: kopf.Index[Any, Any], key: PoolKey, uid: str) -> bool:
    return any(pool["metadata"].get("uid") == uid for pool in index.get(key, ()))


@_stops_itself
@kopf.daemon(GROUP, VERSION, POOLS, cancellation_timeout=STOP_SECONDS)
async def poll_engines(
    namespace: str, name: str, uid: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
    inferencepools_by_key: kopf.Index[Any, Any], **_: Any,
) -> None:
    """Poll the pool's engines every poll interval while it exists. kopf stops the
    daemon when the operator exits or is paused (a standby replica)."""
    key: PoolKey = (namespace, name)
    reconciler = runtime_of(memo).reconciler
    while not stopped and _indexed(inferencepools_by_key, key, uid):
        if reconciler.poll_due(key):
            with timed_reconcile(KIND):
                await reconciler.poll(key)
        await asyncio.sleep(TICK_SECONDS)
