"""TenantQuota handlers: index quotas by pool, reconcile the pool on any change.

One event handler, not kopf's create/update/resume handlers, whose bookkeeping (the
handled spec stored per edit, a diff per event) was most of the operator's CPU at
1,000 quotas; `kvquota.reconcile.quota_changes` lets through the events that change a
policy. No finalizer: deleting a quota never waits for the operator. Why:
docs/operator.md, "TenantQuota events".
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
