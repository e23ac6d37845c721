"""The twin reproduces the noisy-neighbour problem and KVQuota's fix, deterministically.

Small scales only (seconds); the realistic-scale numbers come from `kvquota bench`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvquota_lab.bench.runner import BenchOptions, run_bench


def _bench(scenario: str, **kwargs: Any) -> dict[str, Any]:
    options = BenchOptions(scenario=scenario, progress=False, jobs=1, **kwargs)
    return run_bench(options)


@pytest.fixture(scope="module")
def noisy() -> dict[str, Any]:
    return _bench("noisy-neighbour", scale="small", policies=("fcfs", "kvquota"))


def test_stock_fcfs_lets_the_free_burst_wreck_premium_latency(noisy: dict[str, Any]) -> None:
    ratios = noisy["comparison"]["ttftP99VsBaseline"]
    assert noisy["comparison"]["tier"] == "premium"
    assert ratios["fcfs"] >= 5.0


def test_kvquota_keeps_premium_close_to_its_quiet_latency(noisy: dict[str, Any]) -> None:
    ratios = noisy["comparison"]["ttftP99VsBaseline"]
    fcfs, kvquota = noisy["policies"]["fcfs"], noisy["policies"]["kvquota"]
    assert ratios["kvquota"] <= ratios["fcfs"] / 4
    assert kvquota["tiers"]["premium"]["prefixHitRate"] > fcfs["tiers"]["premium"]["prefixHitRate"]
    # The free tier was held back by admission (it waited in the sidecar's queue), not
    # dropped.
    free = kvquota["tiers"]["free"]
    assert free["queuedP99"] > 0 and free["completed"] == free["requests"]
    # The report says what it waited on (at this scale mostly its own maxBlocks, then
    # the watermark); premium waited on nothing.
    assert free["queuedSecondsBy"]["rejected_quota"] > free["queuedSecondsBy"].get(
        "rejected_watermark", 0) > 0
    assert kvquota["tiers"]["premium"]["queuedSecondsBy"] == {}
    assert all(t["refusedWithinGuarantee"] == 0 for t in kvquota["tiers"].values())
    assert noisy["comparison"]["throughputVsFcfs"]["kvquota"] >= 0.9


def test_leases_keep_idle_premium_conversations_cached() -> None:
    document = _bench("premium-idle-burst", scale="small", policies=("fcfs", "kvquota"),
                      baseline=False)
    premium = {key: p["tiers"]["premium"] for key, p in document["policies"].items()}
    assert premium["fcfs"]["prefixHitRate"] < 0.2  # the burst evicted every conversation
    assert premium["kvquota"]["prefixHitRate"] > 0.8
    assert premium["kvquota"]["ttftP99"] < premium["fcfs"]["ttftP99"]


def test_same_scenario_and_seed_give_the_same_twin_json(tiny_scenario: Path) -> None:
    first = _bench(str(tiny_scenario))
    second = _bench(str(tiny_scenario))
    first.pop("run"), second.pop("run")
    assert first == second
    assert set(first["policies"]) == {"fcfs", "priority", "kvquota"}
    assert first["scenario"]["requests"] > 20
    reseeded = _bench(str(tiny_scenario), seed=2, baseline=False)
    assert reseeded["policies"]["kvquota"] != first["policies"]["kvquota"]


def test_victim_order_variants_run_as_extra_policies(tiny_scenario: Path) -> None:
    document = _bench(str(tiny_scenario), policies=("plugin",), baseline=False,
                      victim_orders=("all",))
    assert set(document["policies"]) == {
        "plugin", "plugin:tier-first", "plugin:running-before-leases", "plugin:newest-first",
    }
    for summary in document["policies"].values():
        assert summary["completed"] == summary["requests"]


@pytest.mark.parametrize(("variant", "first_victim"), [
    (None, "short"),  # documented: the request that loses the least work
    ("newest-first", "long"),  # vLLM's order: the newest arrival
])
def test_a_victim_order_variant_changes_who_is_preempted(
    tiny_model: Path, tmp_path: Path, variant: str | None, first_victim: str
) -> None:
    from engine_sidecar.contract.files import write_atomically
    from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
    from kvquota_lab.bench.variants import victim_ranker
    from kvquota_lab.twin.harness import SchedulerHarness, TwinConfig

    policy_path = tmp_path / "policy.json"
    gold = TenantPolicy(tenant_id="gold", tier="premium", priority=0, guaranteed_blocks=100,
                        max_blocks_per_engine=100, max_tokens=4096, default_max_tokens=64)
    write_atomically(policy_path, EnginePolicy(
        pool="default/pool", model="tiny", block_size=16, tenants={"gold": gold},
    ).with_version().to_json())
    # 12 + 22 blocks at the end into 30: one of the two must give way.
    harness = SchedulerHarness(TwinConfig(
        tiny_model, num_blocks=31, policy_path=policy_path,
        ranker=victim_ranker(variant) if variant is not None else None,
    ))
    try:
        harness.add_request("short", list(range(100, 180)), 100, tenant="gold")
        harness.advance(1)
        harness.add_request("long", list(range(200, 440)), 100, tenant="gold")
        harness.run_until_done()
    finally:
        harness.shutdown()
    preempted = [req_id for step in harness.steps for req_id in step.preempted_req_ids]
    assert preempted[0] == first_victim
