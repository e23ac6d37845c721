"""The engine backend against the real vLLM CPU server, through the real sidecar.

It runs against the session's engine (tests/conftest.py) rather than starting its own;
its tenant ids are unique, so the next policy any test installs drops its leases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_sidecar.contract.files import write_atomically
from kvquota_lab.bench.engine_backend import REQUESTS_FILE, RunningEngine, run_engine_policy
from kvquota_lab.bench.metrics import summarize
from kvquota_lab.bench.policies import POLICIES
from kvquota_lab.bench.scenario import generate_sessions, parse_scenario

pytestmark = pytest.mark.engine

SCENARIO = """
name: engine-smoke
seed: 4
duration: 6
drainTimeout: 120
engine: {capacityBlocks: 320, blockSize: 32, maxNumSeqs: 32, maxModelLen: 2048}
tenants:
  bench-premium:
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
  bench-free:
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


def test_kvquota_through_the_sidecar_leases_and_limits(engine: Any, tmp_path: Path) -> None:
    scenario = parse_scenario(SCENARIO)
    previous = engine.policy_path.read_text() if engine.policy_path.exists() else None
    try:
        result = run_engine_policy(
            scenario, generate_sessions(scenario), POLICIES["kvquota"], tmp_path,
            existing=RunningEngine(engine.url, engine.policy_path, engine.stats_path),
            model=engine.model,
        )
    finally:  # the engine is shared: give it back its policy
        if previous is not None:
            write_atomically(engine.policy_path, previous)
    summary = summarize(result, scenario)
    premium, free = summary["tiers"]["premium"], summary["tiers"]["free"]
    assert premium["completed"] == premium["requests"] == 4
    assert free["completed"] == free["requests"] == 8
    # The clients send max_tokens 16 and 32; the answers end at their drawn lengths
    # (8 and 16 tokens), as a model's end of sequence ends them.
    assert {(o.tier, o.output_tokens) for o in result.outcomes} == {("premium", 8),
                                                                    ("free", 16)}
    # Every second turn found its conversation cached (the plugin leased it): about
    # half of all premium prompt tokens, as the plugin counts them.
    assert result.extra["pluginPrefixHitRate"]["premium"] > 0.4
    # Eight at once against a limit of two: the sidecar queued the other six (it
    # admits a free request only as one of the two finishes) instead of refusing them.
    assert free["rejected429"] == free["rejected503"] == 0
    assert free["queuedP99"] > 0
    assert premium["queuedP99"] == 0
    assert premium["leaseBreaks"] == 0
    assert summary["timeline"]["times"]
    # Every request's timeline, in order, with the sidecar's own split of its part:
    # a queued request's admission took at least its queue wait (1 ms: the header's
    # rounding to the millisecond).
    requests = [json.loads(line) for line in (tmp_path / REQUESTS_FILE).read_text().splitlines()]
    assert len(requests) == 12
    for request in requests:
        assert (request["arrival"] <= request["sent"] <= request["headers"]
                <= request["first_token"] <= request["finish"])
        timing = request["server_timing"]
        assert timing.keys() == {"admit", "upstream"}
        assert timing["admit"] >= request["queued_seconds"] * 1000 - 1
    slowest = result.extra["slowestFirstToken"]
    assert slowest["tier"] == "premium"
    assert slowest["ttftMs"] == round(max(
        r["first_token"] - r["arrival"] for r in requests if r["tier"] == "premium") * 1000, 1)
