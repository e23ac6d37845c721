"""TenantQuota handlers: index quotas by pool, reconcile the pool on any change.

One event handler, not kopf's create/update/resume handlers: those make kopf store
the handled spec in an annotation after every change, a PATCH and one more watch
event per edit, and compute a diff on every event. Kopf's bookkeeping was most of
the operator's CPU per edit at 1,000 quotas, and after a burst of creates the watch
fell seconds behind. The event handler sees every event, our own status writes
included; `kvquota.reconcile.quota_changes` lets through the ones that change a
policy: a new spec, a deletion, the first sight of a quota (a restart re-reconciles
everything, as resume handlers did).

No finalizer: a quota has nothing to clean up but its entry in the pool's policy,
which the DELETED event re-renders away (level-triggered), so deleting a quota never
waits for the operator.
"""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import functools
import time
from typing import Any

import kopf

from kvquota.handlers.common import GROUP, VERSION, retrying, runtime_of, snapshot
from kvquota.metrics import timed_reconcile
from kvquota.reconcile.quota_changes import QuotaChanges, pool_name
from kvquota.reconcile.reconciler import TENANTS, PoolKey

KIND = "TenantQuota"


@kopf.index(GROUP, VERSION, TENANTS)
async def tenantquotas_by_pool(
    namespace: str, spec: kopf.Spec, body: kopf.Body, **_: Any
) -> dict[PoolKey, dict[str, Any]]:
    pool = pool_name(spec)
    return {(namespace, pool): snapshot(body)} if pool else {}


@kopf.on.event(GROUP, VERSION, TENANTS)
async def quota_event(
    type: str | None, namespace: str, name: str, spec: kopf.Spec, memo: kopf.Memo,
    logger: kopf.Logger, **_: Any,
) -> None:
    """Re-render the referenced pool, and the previous one if `poolRef` moved; a
    deleted quota leaves its pool's policy."""
    seen = time.monotonic()
    runtime = runtime_of(memo)
    changes: QuotaChanges = runtime.quota_changes
    deleted = type == "DELETED"
    pools = changes.pools(namespace, name, spec, deleted=deleted)
    if not pools:
        return
    reconciler = runtime.reconciler
    if deleted:
        reconciler.forget(TENANTS, namespace, name)
    with timed_reconcile(KIND):
        for pool in pools:
            key: PoolKey = (namespace, pool)
            try:
                await retrying(functools.partial(reconciler.reconcile, key, since=seen), logger)
            except Exception:
                if not deleted:
                    changes.forget(namespace, name)
                raise
