"""Small scenarios for the bench tests (seconds of CPU, not minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Two tenants, a few dozen requests: enough for every metric to have data.
TINY = """
name: tiny
description: a premium chat and a free burst on a small engine
seed: 1
duration: 20
drainTimeout: 120
engine: {capacityBlocks: 800, blockSize: 16, maxNumSeqs: 32, maxNumBatchedTokens: 1024,
         maxModelLen: 4096}
tenants:
  acme:
    tier: premium
    kvCache: {guaranteedBlocks: "50%", maxBlocks: "70%", lease: {maxBlocks: "30%"}}
    workloads:
      chat:
        arrival: {process: poisson, rate: 0.3}
        turns: 3
        thinkTime: {dist: uniform, low: 2, high: 4}
        promptTokens: {dist: uniform, low: 300, high: 600}
        turnTokens: 30
        outputTokens: {dist: uniform, low: 10, high: 30}
        maxTokens: 64
  hobbyist:
    tier: free
    kvCache: {guaranteedBlocks: "5%", maxBlocks: "40%"}
    limits: {maxConcurrentRequests: 8}
    workloads:
      burst:
        arrival: {process: bursts, every: 8, size: 12, spread: 1, start: 2}
        promptTokens: {dist: uniform, low: 300, high: 500}
        outputTokens: 20
        maxTokens: 64
slo:
  premium: {ttft: 1.0, tpot: 0.1}
"""


@pytest.fixture
def tiny_scenario(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def tiny_scenario_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "tiny.yaml"
    path.write_text(TINY)
    return path
