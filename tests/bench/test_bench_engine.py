"""The engine backend against the real vLLM CPU server, through the real sidecar."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvquota.bench.engine_backend import run_engine_policy
from kvquota.bench.metrics import summarize
from kvquota.bench.scenario import generate_sessions, parse_scenario
from kvquota.bench.twin import POLICIES

pytestmark = pytest.mark.engine

SCENARIO = """
name: engine-smoke
seed: 4
duration: 6
drainTimeout: 120
engine: {capacityBlocks: 320, blockSize: 32, maxNumSeqs: 32, maxModelLen: 2048}
tenants:
  acme:
    tier: premium
    kvCache: {guaranteedBlocks: "50%", maxBlocks: "70%"}
    workloads:
      chat:
        arrival: {process: bursts, every: 1, size: 1, count: 2}
        turns: 2
        thinkTime: 1
        promptTokens: 600
        turnTokens: 20
        outputTokens: 8
        maxTokens: 16
  hobbyist:
    tier: free
    kvCache: {guaranteedBlocks: "5%", maxBlocks: "40%"}
    limits: {maxConcurrentRequests: 2}
    workloads:
      burst:
        arrival: {process: bursts, every: 10, size: 8, start: 0.5}
        promptTokens: 300
        outputTokens: 16
        maxTokens: 32
"""


def test_kvquota_through_the_sidecar_leases_and_limits(tiny_model: Path, tmp_path: Path) -> None:
    scenario = parse_scenario(SCENARIO)
    result = run_engine_policy(scenario, generate_sessions(scenario), POLICIES["kvquota"],
                               tmp_path)
    summary = summarize(result, scenario)
    premium, free = summary["tiers"]["premium"], summary["tiers"]["free"]
    assert premium["completed"] == premium["requests"] == 4
    assert free["completed"] == free["requests"] == 8
    # The second turn found its conversation cached (the plugin leased it).
    assert premium["prefixHitRate"] > 0.8
    # Eight at once against a limit of two: the sidecar said 429, the client retried.
    assert free["rejected429"] > 0
    assert premium["leaseBreaks"] == 0
    assert summary["timeline"]["times"]
