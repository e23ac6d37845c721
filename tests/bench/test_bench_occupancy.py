"""How full the cache was and how long a tenant sat at its own ceiling: what the report
shows for each policy, and how the suite judges it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from kvquota_lab.bench.occupancy import Occupancy, TenantLimits
from kvquota_lab.bench.plugin_counts import outgrown_by_tier
from kvquota_lab.bench.report import format_table
from kvquota_lab.bench.runner import BenchOptions, run_bench

# A premium chat with room to spare beside a free tenant whose quota fits two of its
# requests at a time: the answers are as long as max_tokens, so what admission
# reserves is what the requests hold, and the free tenant holds its maxBlocks (a hard
# ceiling: aboveMax Never).
AT_CEILING = """
name: at-ceiling
seed: 4
duration: 20
drainTimeout: 120
engine: {capacityBlocks: 800, blockSize: 16, maxNumSeqs: 32, maxNumBatchedTokens: 1024,
         maxModelLen: 2048}
tenants:
  acme:
    tier: premium
    kvCache: {guaranteedBlocks: "40%", maxBlocks: "60%"}
    workloads:
      chat:
        arrival: {process: poisson, rate: 0.3}
        promptTokens: {dist: uniform, low: 200, high: 400}
        outputTokens: 16
        maxTokens: 16
  hobbyist:
    tier: free
    kvCache: {guaranteedBlocks: 0, maxBlocks: 126, aboveMax: Never}
    limits: {maxConcurrentRequests: 4}
    workloads:
      burst:
        arrival: {process: bursts, every: 6, size: 10, spread: 0.5, start: 1}
        promptTokens: 800
        outputTokens: 200
        maxTokens: 200
"""


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("occupancy") / "at-ceiling.yaml"
    path.write_text(AT_CEILING)
    return run_bench(BenchOptions(scenario=str(path), policies=("priority", "kvquota"),
                                  baseline=False, progress=False, jobs=1))


def test_every_policy_reports_its_mean_kv_in_use(document: dict[str, Any]) -> None:
    for summary in document["policies"].values():
        assert 0.0 < summary["kvInUse"] < 1.0
        assert summary["loadWindowSeconds"] == 20
    table = format_table(document)
    line = next(x for x in table.splitlines() if x.startswith("mean KV blocks in use"))
    ratio = document["policies"]["kvquota"]["kvInUse"] / document["policies"]["priority"][
        "kvInUse"]
    assert f"({ratio:.2f}x priority)" in line and "0-20 s" in line


def test_a_tenant_holding_its_max_blocks_is_reported_at_that_ceiling(
    document: dict[str, Any],
) -> None:
    ours = document["policies"]["kvquota"]
    free = ours["tiers"]["free"]["atCeiling"]["hobbyist"]
    assert free["maxBlocks"] == 126 and free["peakHeld"] <= 126
    assert 0 < free["secondsAtMaxBlocks"] <= 20
    premium = ours["tiers"]["premium"]["atCeiling"]["acme"]
    assert premium["secondsAtMaxBlocks"] == 0 and premium["secondsAtMaxConcurrent"] is None
    assert "hobbyist (free) maxBlocks 126:" in format_table(document)
    # Stock vLLM enforces no quota: nothing to be at.
    assert document["policies"]["priority"]["tiers"]["free"]["atCeiling"] is None


def test_outgrown_estimate_preemptions_show_per_tier_for_kvquota_only(
    document: dict[str, Any],
) -> None:
    assert "outgrown" in format_table(document).splitlines()[0]
    for tier in document["policies"]["kvquota"]["tiers"].values():
        assert isinstance(tier["outgrownPreemptions"], int)
    for tier in document["policies"]["priority"]["tiers"].values():
        assert tier["outgrownPreemptions"] is None


def test_outgrown_preemptions_are_summed_per_tier_from_the_plugin_stats() -> None:
    stats = EngineStats(timestamp=0.0, tenants={
        "a": TenantEngineStats(outgrown_preemptions=2),
        "b": TenantEngineStats(outgrown_preemptions=3),
        "c": TenantEngineStats(outgrown_preemptions=1),
        "_unclassified": TenantEngineStats(outgrown_preemptions=4),
    })
    assert outgrown_by_tier(stats, {"a": "free", "b": "free", "c": "premium"}) == {
        "free": 5, "premium": 1}
    # A stats file from a plugin without the counter: every tier reads 0.
    older = EngineStats.model_validate_json('{"timestamp": 0, "tenants": {"a": {}}}')
    assert outgrown_by_tier(older, {"a": "free"}) == {"free": 0}


def test_only_the_load_window_counts_and_time_is_weighted() -> None:
    occupancy = Occupancy(10.0, 100, {"t": TenantLimits("free", 50, 2)})
    occupancy.add_kv(0.0, 2.0, 100)  # full for 2 s
    occupancy.add_kv(2.0, 10.0, 0)  # empty for 8 s
    occupancy.add_kv(10.0, 50.0, 100)  # after the window: ignored
    assert occupancy.kv_share == pytest.approx(0.2)
    occupancy.add_tenants(0.0, 4.0, {"t": 45}, {"t": 2})  # >= 90% of 50, 2 in flight
    occupancy.add_tenants(4.0, 12.0, {"t": 44}, {"t": 1})
    ceiling = occupancy.to_json()["ceilings"]["t"]
    assert ceiling["secondsAtMaxBlocks"] == 4.0 and ceiling["secondsAtMaxConcurrent"] == 4.0


def test_the_cli_applies_set_overrides_to_the_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvquota.cli import main

    path = tmp_path / "at-ceiling.yaml"
    path.write_text(AT_CEILING)
    out = tmp_path / "out.json"
    code = main(["bench", "--scenario", str(path), "--policies", "kvquota", "--no-baseline",
                 "--jobs", "1", "--no-progress", "--json", str(out),
                 "--set", "tenants.hobbyist.kvCache.maxBlocks=130"])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["scenario"]["overrides"] == {
        "tenants": {"hobbyist": {"kvCache": {"maxBlocks": 130}}}}
    assert document["policies"]["kvquota"]["ceilings"]["hobbyist"]["maxBlocks"] == 130
    capsys.readouterr()
    assert main(["bench", "--scenario", str(path), "--set", "pool.watermark"]) == 2
    assert "give PATH=VALUE" in capsys.readouterr().err


def test_answers_cut_at_the_tier_ceiling_are_counted_for_kvquota(tmp_path: Path) -> None:
    """A tenant whose maxTokens is below what its answers run to: KVQuota clamps them
    (stock vLLM generates what the client asked for) and the report counts the cut."""
    path = tmp_path / "at-ceiling.yaml"
    path.write_text(AT_CEILING)
    document = run_bench(BenchOptions(
        scenario=str(path), policies=("priority", "kvquota"), baseline=False,
        progress=False, jobs=1, overrides={"tenants": {"hobbyist": {"limits": {"maxTokens": 8}}}},
    ))
    ours = document["policies"]["kvquota"]["tiers"]
    stock = document["policies"]["priority"]["tiers"]
    free = ours["free"]
    assert free["answersCutAtMaxTokens"] == free["completed"] > 0
    assert free["tokensCutAtMaxTokens"] == (200 - 8) * free["completed"]
    assert free["outputTokens"] == 8 * free["completed"]
    assert ours["premium"]["answersCutAtMaxTokens"] == 0
    assert stock["free"]["answersCutAtMaxTokens"] == 0
    assert free["atCeiling"]["hobbyist"]["maxTokens"] == 8


# A burst whose answers run far past what its tenant's requests are expected to
# produce (defaultMaxTokens 16, no finished request to learn from yet): admitted at
# their small estimates, they outgrow the cache together and the plugin preempts some.
OUTGROWN = """
name: outgrown
seed: 2
duration: 5
drainTimeout: 300
engine: {capacityBlocks: 200, blockSize: 16, maxNumSeqs: 32, maxNumBatchedTokens: 2048,
         maxModelLen: 1024}
tenants:
  hobbyist:
    tier: free
    kvCache: {guaranteedBlocks: 0, maxBlocks: 190}
    limits: {defaultMaxTokens: 16}
    workloads:
      burst:
        arrival: {process: bursts, every: 100, size: 16, spread: 0.1, start: 0.5}
        promptTokens: 100
        outputTokens: 400
        maxTokens: 400
"""


def test_the_twin_counts_preemptions_of_requests_that_outgrew_their_estimate(
    tmp_path: Path,
) -> None:
    """The twin tells the plugin what each turn reserved, as the sidecar does, so a
    victim holding more than that is counted as outgrown."""
    path = tmp_path / "outgrown.yaml"
    path.write_text(OUTGROWN)
    document = run_bench(BenchOptions(scenario=str(path), policies=("kvquota",),
                                      baseline=False, progress=False, jobs=1))
    free = document["policies"]["kvquota"]["tiers"]["free"]
    assert free["outgrownPreemptions"] > 0, free
