"""A pool's premium p99 is compared with one engine at the same per-engine load: the p99
of single-engine KVQuota runs on several seeds with their turns pooled, not one run's.
(test_bench_pool checks a real pool bench carries it.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvquota_lab.bench.metrics import Outcome, RunResult, Timeline
from kvquota_lab.bench.one_engine import (
    MAX_SEEDS,
    add_reference,
    pooled_reference,
    reference_seeds,
    tier_ttfts,
)
from kvquota_lab.bench.pool_report import format_pool_table, pool_rows
from kvquota_lab.percentile import percentile


def _document(p99s: dict[str, float | None]) -> dict[str, Any]:
    return {"comparison": {"tier": "premium"}, "run": {"wallSeconds": {}},
            "pool": {"replicas": 8, "router": "prefix-affinity"},
            "policies": {key: {"tiers": {"premium": {"ttftP99": p99,
                                                     "refusedWithinGuarantee": 0}},
                               "extra": {}, "throughput": 1.0}
                         for key, p99 in p99s.items()}}


def _run(key: str, ttfts: list[float]) -> RunResult:
    outcomes = [Outcome("acme", "premium", f"s{i}", 1, arrival=0.0, first_token=t,
                        status="ok") for i, t in enumerate(ttfts)]
    outcomes.append(Outcome("hob", "free", "f", 1, arrival=0.0, first_token=9.0, status="ok"))
    return RunResult(key=key, label=key, outcomes=outcomes, timeline=Timeline())


def test_the_reference_pools_the_seeds_turns() -> None:
    # Seed 31 alone: its slowest turn dominates; pooled, the tail rests on 300 turns.
    runs = [_run("a", [0.1] * 98 + [2.0] * 2), _run("b", [0.2] * 100), _run("c", [0.3] * 100)]
    reference = pooled_reference(runs, [31, 32, 33], "premium")
    every = [t for run in runs for t in tier_ttfts(run, "premium")]
    assert reference["turns"] == 300
    assert reference["ttftP99"] == pytest.approx(percentile(every, 99), abs=1e-4)
    assert reference["ttftP99PerSeed"][0] == pytest.approx(2.0)
    assert reference["ttftP99"] == pytest.approx(0.3)


def test_the_pool_table_shows_kvquotas_p99_over_the_reference() -> None:
    document = _document({"priority": 0.5, "kvquota:demand:signals": 0.36})
    add_reference(document, {"policy": "kvquota", "seeds": list(range(31, 39)),
                             "turns": 530, "ttftP99": 0.3, "ttftP99PerSeed": []})
    rows = {row["run"]: row for row in pool_rows(document)}
    assert rows["kvquota:demand:signals"]["ttftP99VsOneEngine"] == pytest.approx(1.2)
    assert rows["priority"]["ttftP99VsOneEngine"] is None  # KVQuota's target only
    table = format_pool_table(document)
    assert "1 engine (kvquota, seeds 31-38, 530 turns pooled) 0.300 s" in table
    assert " 1.20 " in table.splitlines()[-1]


def test_the_seed_count_follows_the_pool_up_to_eight() -> None:
    assert reference_seeds(31, 3) == [31, 32, 33]
    assert reference_seeds(31, 64) == list(range(31, 31 + MAX_SEEDS))
    assert reference_seeds(31, 64, count=2) == [31, 32]
    assert reference_seeds(31, 8, count=0) == []
    with pytest.raises(ValueError, match="--one-engine-seeds must be >= 0"):
        reference_seeds(31, 8, count=-1)
