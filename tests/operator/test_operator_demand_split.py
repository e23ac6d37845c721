"""With `spec.quotaSplit: Demand` the operator moves a tenant's per-engine split toward
the engine with its demand (kopf against the KMock emulator, fake sidecar status
endpoints): the ConfigMap's per-engine entries, the TenantQuota status and the metrics
all show it. The default, Even, moves nothing whatever the demand."""

from __future__ import annotations

from operator_harness import Cluster, FakeEngines
from operator_objects import pool, quota
from prometheus_client import REGISTRY

from engine_sidecar.contract.policy import EnginePolicy
from kvquota_lab.emulator import OperatorRunner

SPLIT = {"namespace": "default", "pool": "demo-pool", "tenant_id": "acme"}


def _on(policy: EnginePolicy, pod: str) -> tuple[int, int]:
    entry = policy.for_engine(pod).tenants["acme"]
    return entry.guaranteed_blocks, entry.max_blocks_per_engine


async def test_split_follows_demand_over_poll_rounds_and_keeps_the_totals(
    cluster: Cluster, operator: OperatorRunner, engines: FakeEngines
) -> None:
    busy = await engines.add("engine-a")
    await engines.add("engine-b")
    await cluster.create(pool(capacity=1000))
    await cluster.create(quota("acme", tier="premium", guaranteed=400, maximum=600))

    async def even() -> EnginePolicy | None:
        policy = await cluster.policy("demo-pool")
        return policy if policy is not None and policy.replicas == 2 else None

    policy = await cluster.wait_for(even, "the even split over two engines")
    assert _on(policy, "engine-a") == _on(policy, "engine-b") == (200, 300)
    assert policy.engines == {}

    # The router sends all of acme to engine-a: its share is full and requests queue
    # and are refused there, while engine-b holds acme's other half idle.
    busy.report("acme", usage={"reservedBlocks": 190, "inflight": 10, "queued": 20},
                counters={"admitted": 40, "rejectedQuota": 6})
    # The pool's default split is Even: over six poll rounds that saw the demand (with
    # Demand, two rounds of half an even share each would have moved nearly all), nothing
    # moves and no per-engine gauge appears.
    rounds = busy.polls + 6

    async def polled() -> bool:
        return busy.polls >= rounds

    await cluster.wait_for(polled, "six poll rounds after the demand")
    policy = await cluster.wait_for(even, "the even split over two engines")
    assert policy.engines == {}
    assert REGISTRY.get_sample_value("kvquota_operator_engine_guaranteed_blocks",
                                     {**SPLIT, "engine": "engine-a"}) is None
    await cluster.patch("InferencePool", "demo-pool", {"spec": {"quotaSplit": "Demand"}})

    seen: list[int] = []

    async def moved_all_the_way() -> EnginePolicy | None:
        policy = await cluster.policy("demo-pool")
        if policy is None:
            return None
        (g_a, m_a), (g_b, m_b) = _on(policy, "engine-a"), _on(policy, "engine-b")
        assert g_a + g_b == 400, "the pool-wide guarantee is invariant"
        assert m_a - g_a == 100, "an engine gaining guarantee gains its ceiling too"
        assert m_b == max(300, g_b + 100), "one giving it keeps the even ceiling"
        assert policy.tenants["acme"].guaranteed_blocks == 200, "the fallback stays even"
        if not seen or seen[-1] != g_a:
            seen.append(g_a)
        # engine-b, idle, keeps only its deadband (5% of its even share, 10 blocks).
        return policy if g_a == 390 else None

    policy = await cluster.wait_for(moved_all_the_way, "acme's guarantee moved to engine-a")
    assert seen == sorted(seen) and seen[0] == 200, f"moved one way, from even: {seen}"
    assert _on(policy, "engine-b") == (10, 300)
    assert set(policy.engines) == {"engine-a", "engine-b"}  # only acme, where it moved

    acme = await cluster.wait_status(
        "TenantQuota", "acme",
        lambda o: (o.get("status") or {}).get("engines", [{}])[0].get("guaranteedBlocks") == 390,
        "the per-engine split in status")
    assert acme["status"]["engines"] == [
        {"pod": "engine-a", "guaranteedBlocks": 390, "maxBlocks": 490},
        {"pod": "engine-b", "guaranteedBlocks": 10, "maxBlocks": 300},
    ]
    assert acme["status"]["effective"]["guaranteedBlocksPerEngine"] == 200
    assert REGISTRY.get_sample_value("kvquota_operator_engine_guaranteed_blocks",
                                     {**SPLIT, "engine": "engine-a"}) == 390
    assert REGISTRY.get_sample_value("kvquota_operator_engine_max_blocks",
                                     {**SPLIT, "engine": "engine-b"}) == 300
