"""Deleting a pool never waits for the operator: pools carry no finalizer, a pool
deleted while no operator runs is gone at once, and pools that still carry the
finalizer older releases put on them lose it when the operator starts."""

from __future__ import annotations

from typing import Any

from operator_harness import Cluster
from operator_objects import condition, pool, quota

from kvquota.reconcile.configmap import configmap_name
from kvquota.settings import FINALIZER
from kvquota_lab.emulator import OperatorRunner

CM = configmap_name("demo-pool")


async def _rendered(cluster: Cluster) -> None:
    async def probe() -> Any:
        policy = await cluster.policy("demo-pool")
        return policy if policy and list(policy.tenants) == ["acme"] else None

    await cluster.wait_for(probe, "the pool's policy")


async def _told_pool_is_gone(cluster: Cluster) -> None:
    async def probe() -> Any:
        acme = await cluster.get("TenantQuota", "acme")
        try:
            ready = condition((acme or {}).get("status"), "Ready")
        except AssertionError:
            return None
        return acme if ready["reason"] == "PoolNotFound" else None

    await cluster.wait_for(probe, "acme told its pool is gone")


async def test_a_pool_deleted_while_no_operator_runs_is_gone_at_once(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool())
    await cluster.create(quota("acme", guaranteed=10))
    await _rendered(cluster)
    served = await cluster.get("InferencePool", "demo-pool")
    assert served is not None and not served["metadata"].get("finalizers")

    await operator.stop()
    await cluster.delete("InferencePool", "demo-pool")
    assert await cluster.get("InferencePool", "demo-pool") is None  # no Terminating

    async def configmap_gone() -> bool:
        return await cluster.get("ConfigMap", CM) is None

    await cluster.wait_for(configmap_gone, "the ConfigMap collected with its owner")

    await operator.start()  # the operator comes back to a pool it never saw go
    await _told_pool_is_gone(cluster)
    assert await cluster.get("ConfigMap", CM) is None  # nothing resurrected
    assert await cluster.get("InferencePool", "demo-pool") is None


async def test_the_operator_removes_the_finalizer_older_releases_put_on_pools(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await operator.stop()
    old = pool()
    old["metadata"]["finalizers"] = [FINALIZER]  # as 0.x operators left it
    await cluster.create(old)
    stuck = pool(name="stuck-pool")
    stuck["metadata"]["finalizers"] = [FINALIZER]
    await cluster.create(stuck)
    await cluster.delete("InferencePool", "stuck-pool")  # Terminating: the old hang
    waiting = await cluster.get("InferencePool", "stuck-pool")
    assert waiting is not None and waiting["metadata"].get("deletionTimestamp")
    await cluster.create(quota("acme", guaranteed=10))

    await operator.start()

    async def released() -> Any:
        demo = await cluster.get("InferencePool", "demo-pool")
        return demo if demo and not demo["metadata"].get("finalizers") else None

    await cluster.wait_for(released, "the old finalizer removed from demo-pool")

    async def stuck_gone() -> bool:
        return await cluster.get("InferencePool", "stuck-pool") is None

    await cluster.wait_for(stuck_gone, "the pool stuck Terminating deleted")
    await _rendered(cluster)  # still served, now deletable at any time
    await operator.stop()
    await cluster.delete("InferencePool", "demo-pool")
    assert await cluster.get("InferencePool", "demo-pool") is None
