"""The single-engine reference a pool's protected-tier TTFT p99 is compared with.

A pool of N engines serves about N times the turns one engine serves at the same
per-engine load, so the pool's p99 is the 99th percentile of many turns while one
single-engine run's p99 is its slowest turn or two. The reference is therefore the p99
of the protected tier's TTFTs of K single-engine KVQuota runs on consecutive seeds (the
pool's seed first), pooled: both sides rest on about as many turns. K is the replica
count, at most `MAX_SEEDS`: past a few hundred turns the pooled p99 moves less than the
pool's own does between seeds, and each further seed costs one more engine's run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvquota_lab.bench.metrics import RunResult
from kvquota_lab.bench.policies import POLICIES, PolicySpec
from kvquota_lab.bench.scenario import Scenario, load_scenario
from kvquota_lab.percentile import percentile

MAX_SEEDS = 8
KEY_PREFIX = "1-engine"


def reference_seeds(first: int, replicas: int, count: int | None = None) -> list[int]:
    """The seeds of the reference runs: `count` of them (default: `replicas`, at most
    `MAX_SEEDS`) from the pool's own seed on."""
    k = min(replicas, MAX_SEEDS) if count is None else count
    if k < 0:
        raise ValueError(f"--one-engine-seeds must be >= 0, not {k}")
    return [first + i for i in range(k)]


def reference_tasks(
    source: str, scale: str | None, overrides: dict[str, Any], seeds: list[int]
) -> list[tuple[Scenario, PolicySpec]]:
    """One KVQuota run per seed on one engine: the scenario as written (its per-engine
    load, not the pool's), keyed apart so each reports its own progress."""
    spec = POLICIES["kvquota"]
    return [
        (load_scenario(source, scale=scale, seed=seed, overrides=overrides),
         replace(spec, key=f"{KEY_PREFIX}:{spec.key}:{seed}",
                 label=f"{spec.label}, 1 engine, seed {seed}"))
        for seed in seeds
    ]


def tier_ttfts(run: RunResult, tier: str) -> list[float]:
    """The tier's TTFTs as the report counts them: completed turns, first attempt on."""
    return [t for o in run.outcomes
            if o.tier == tier and o.status == "ok" and (t := o.ttft) is not None]


def pooled_reference(runs: list[RunResult], seeds: list[int], tier: str) -> dict[str, Any]:
    """The reference: the p99 of every run's `tier` TTFTs together, and each run's own
    (what one seed alone would have given)."""
    samples = [tier_ttfts(run, tier) for run in runs]
    pooled = [t for one in samples for t in one]
    p99 = percentile(pooled, 99)
    return {
        "policy": POLICIES["kvquota"].key,
        "seeds": list(seeds),
        "turns": len(pooled),
        "ttftP99": None if p99 is None else round(p99, 4),
        "ttftP99PerSeed": [
            None if (v := percentile(one, 99)) is None else round(v, 4) for one in samples
        ],
    }


def add_reference(document: dict[str, Any], reference: dict[str, Any]) -> None:
    """The report's comparison gains `oneEngine` (the reference) and, per KVQuota run,
    its protected tier's p99 over the reference's (`ttftP99VsOneEngine`; None for the
    stock policies, which `x priority` compares instead)."""
    comparison = document["comparison"]
    tier = comparison.get("tier")
    base = reference["ttftP99"]
    comparison["oneEngine"] = reference
    ratios: dict[str, float | None] = {}
    own = reference["policy"]
    for key, summary in document["policies"].items():
        if key != own and not key.startswith(f"{own}:"):
            ratios[key] = None
            continue
        p99 = summary["tiers"].get(tier, {}).get("ttftP99") if tier else None
        ratios[key] = None if p99 is None or not base else round(p99 / base, 3)
    comparison["ttftP99VsOneEngine"] = ratios
