"""TenantQuota handlers: index quotas by pool, reconcile the pool on any change.

No finalizer: a quota has nothing to clean up but its entry in the pool's policy,
which the DELETED event re-renders away (level-triggered), so deleting a quota never
waits for the operator.
"""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import kopf

from kvquota.handlers.common import BACKOFF, GROUP, VERSION, deleted, retrying, snapshot
from kvquota.metrics import timed_reconcile
from kvquota.reconciler import TENANTS, PoolKey
from kvquota.runtime import runtime_of

KIND = "TenantQuota"


def _pool_name(spec: Mapping[str, Any] | None) -> str | None:
    ref = (spec or {}).get("poolRef") or {}
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return str(name) if name else None


@kopf.index(GROUP, VERSION, TENANTS)
def tenantquotas_by_pool(
    namespace: str, spec: kopf.Spec, body: kopf.Body, **_: Any
) -> dict[PoolKey, dict[str, Any]]:
    pool = _pool_name(spec)
    return {(namespace, pool): snapshot(body)} if pool else {}


@kopf.on.resume(GROUP, VERSION, TENANTS, backoff=BACKOFF)
@kopf.on.create(GROUP, VERSION, TENANTS, backoff=BACKOFF)
@kopf.on.update(GROUP, VERSION, TENANTS, backoff=BACKOFF)
async def quota_changed(
    namespace: str, spec: kopf.Spec, old: Mapping[str, Any] | None, memo: kopf.Memo,
    **_: Any,
) -> None:
    """Re-render the referenced pool, and the previous one if `poolRef` moved."""
    seen = time.monotonic()
    pools = {_pool_name(spec), _pool_name((old or {}).get("spec"))} - {None}
    reconciler = runtime_of(memo).reconciler
    with timed_reconcile(KIND):
        for pool in sorted(p for p in pools if p):
            await reconciler.reconcile((namespace, pool), since=seen)


@kopf.on.event(GROUP, VERSION, TENANTS, when=deleted)
async def quota_deleted(
    namespace: str, name: str, spec: kopf.Spec, memo: kopf.Memo,
    logger: kopf.Logger, **_: Any,
) -> None:
    """A deleted quota leaves its pool's policy."""
    seen = time.monotonic()
    pool = _pool_name(spec)
    if pool is None:
        return
    reconciler = runtime_of(memo).reconciler
    reconciler.forget(TENANTS, namespace, name)
    with timed_reconcile(KIND):
        await retrying(lambda: reconciler.reconcile((namespace, pool), since=seen), logger)
