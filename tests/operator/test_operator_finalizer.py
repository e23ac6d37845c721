"""A pool deleted while the operator is down: it waits in Terminating for the
operator's finalizer, and the README's way out (remove the finalizer) loses nothing."""

from __future__ import annotations

from typing import Any

from operator_harness import Cluster
from operator_objects import condition, pool, quota

from kvquota.configmap import configmap_name
from kvquota.settings import FINALIZER
from kvquota_lab.emulator import OperatorRunner

CM = configmap_name("demo-pool")
# The README's command, as the JSON patch kubectl sends.
REMOVE_FINALIZERS = [{"op": "remove", "path": "/metadata/finalizers"}]


async def _json_patch(cluster: Cluster, name: str, patch: list[dict[str, Any]]) -> None:
    url = f"{cluster.url}/apis/kvquota.dev/v1alpha1/namespaces/default/inferencepools/{name}"
    async with cluster.session.patch(
        url, json=patch, headers={"Content-Type": "application/json-patch+json"}
    ) as response:
        assert response.status < 400, await response.text()


async def test_removing_the_finalizer_of_a_pool_stuck_terminating_loses_nothing(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool())
    await cluster.create(quota("acme", guaranteed=10))

    async def rendered() -> Any:
        policy = await cluster.policy("demo-pool")
        return policy if policy and list(policy.tenants) == ["acme"] else None

    await cluster.wait_for(rendered, "the pool's policy")
    held = await cluster.get("InferencePool", "demo-pool")
    assert held is not None and held["metadata"]["finalizers"] == [FINALIZER]

    await operator.stop()
    await cluster.delete("InferencePool", "demo-pool")
    stuck = await cluster.get("InferencePool", "demo-pool")
    assert stuck is not None and stuck["metadata"].get("deletionTimestamp")  # Terminating

    await _json_patch(cluster, "demo-pool", REMOVE_FINALIZERS)
    assert await cluster.get("InferencePool", "demo-pool") is None

    async def configmap_gone() -> bool:
        return await cluster.get("ConfigMap", CM) is None

    await cluster.wait_for(configmap_gone, "the ConfigMap collected with its owner")

    await operator.start()  # the operator comes back to a pool it never saw go

    async def acme_without_pool() -> Any:
        acme = await cluster.get("TenantQuota", "acme")
        try:
            ready = condition((acme or {}).get("status"), "Ready")
        except AssertionError:
            return None
        return acme if ready["reason"] == "PoolNotFound" else None

    await cluster.wait_for(acme_without_pool, "acme told its pool is gone")
    assert await cluster.get("ConfigMap", CM) is None  # nothing resurrected
    assert await cluster.get("InferencePool", "demo-pool") is None
