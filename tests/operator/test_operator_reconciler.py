"""The reconciler on its own, against in-memory stand-ins for the API and the engines."""

from __future__ import annotations

from typing import Any, cast

from operator_objects import pool, quota

from kvquota.api import LabelSelector
from kvquota.reconcile.engines import EnginePoller
from kvquota.reconcile.kube import KubeApi
from kvquota.reconcile.reconciler import POOLS, TENANTS, Coalescer, PoolKey, PoolReconciler
from kvquota.reconcile.status_writer import StatusWriter
from kvquota.reconcile.usage import EngineObservation
from kvquota.runtime import OperatorConfig

KEY: PoolKey = ("default", "demo-pool")


class _Kube:
    """What the reconciler calls on KubeApi: ConfigMaps and status patches, in memory."""

    def __init__(self) -> None:
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        self.statuses: dict[tuple[str, str, str], dict[str, Any]] = {}

    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.configmaps.get((namespace, name))

    async def create_configmap(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        self.configmaps[(meta["namespace"], meta["name"])] = body

    async def patch_configmap(self, namespace: str, name: str, patch: dict[str, Any]) -> bool:
        return (namespace, name) in self.configmaps

    async def patch_status(self, plural: str, namespace: str, name: str,
                           status: dict[str, Any]) -> bool:
        self.statuses.setdefault((plural, namespace, name), {}).update(status)
        return True


class _Engines:
    async def observe(self, namespace: str, selector: LabelSelector) -> EngineObservation:
        return EngineObservation(matched=1, ready=("engine-0",))


def _holding(reconciler: PoolReconciler, key: PoolKey) -> list[str]:
    """The reconciler's attributes (and its coalescers' slots) that still hold `key`,
    as a pool key or as the pool object's."""
    found = []
    for name, value in vars(reconciler).items():
        if isinstance(value, StatusWriter):
            if value.holds((POOLS, *key)):
                found.append(name)
            continue
        if isinstance(value, Coalescer):
            value = value._slots
        if isinstance(value, dict | set) and (key in value or (POOLS, *key) in value):
            found.append(name)
    return found


async def test_a_deleted_pool_leaves_no_per_pool_state_behind() -> None:
    kube = _Kube()
    reconciler = PoolReconciler(cast("KubeApi", kube), cast("EnginePoller", _Engines()),
                                OperatorConfig())
    pools: dict[PoolKey, list[dict[str, Any]]] = {KEY: [pool()]}
    tenants: dict[PoolKey, list[dict[str, Any]]] = {KEY: [quota("acme", guaranteed=10)]}
    reconciler.bind(pools, tenants)
    await reconciler.poll(KEY)
    assert kube.configmaps and (TENANTS, "default", "acme") in kube.statuses
    assert _holding(reconciler, KEY)

    # The pool goes first (as the handler does it): its quota waits with PoolNotFound.
    del pools[KEY]
    reconciler.forget(POOLS, *KEY)
    await reconciler.reconcile(KEY)
    reasons = {c["type"]: c["reason"]
               for c in kube.statuses[(TENANTS, "default", "acme")]["conditions"]}
    assert reasons["Accepted"] == "PoolNotFound"

    # Then its last quota: nothing about the pool is kept.
    del tenants[KEY]
    reconciler.forget(TENANTS, "default", "acme")
    await reconciler.reconcile(KEY)
    assert _holding(reconciler, KEY) == []
