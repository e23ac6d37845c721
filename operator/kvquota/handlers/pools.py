"""InferencePool handlers: index pools, reconcile on change, poll engines on a timer.

The timer makes kopf put its finalizer (`kvquota.dev/finalizer`) on pools, so it can
stop the timer before the pool goes; deleting a pool while the operator is down waits
until it is back. The ConfigMap needs no cleanup: its ownerReference lets the garbage
collector delete it.
"""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import time
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
from kvquota.reconciler import POOLS, PoolKey

KIND = "InferencePool"
TICK_SECONDS = 0.5  # timer resolution; the poll interval itself is OperatorConfig's


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


@kopf.timer(GROUP, VERSION, POOLS, interval=TICK_SECONDS)
async def poll_engines(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    reconciler = runtime_of(memo).reconciler
    if reconciler.poll_due((namespace, name)):
        with timed_reconcile(KIND):
            await reconciler.poll((namespace, name))
