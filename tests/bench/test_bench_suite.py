"""`kvquota bench suite`: the targets are judged from a bench document, one table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvquota.bench.runner import BenchOptions, run_bench
from kvquota.bench.suite import (
    TARGET_NAMES,
    CaseResult,
    evaluate,
    format_markdown,
    format_suite,
    suite_cases,
)


@pytest.fixture(scope="module")
def document(tiny_scenario_module: Path) -> dict[str, Any]:
    return run_bench(BenchOptions(scenario=str(tiny_scenario_module), progress=False, jobs=1))


def test_every_target_is_judged_with_its_value(document: dict[str, Any]) -> None:
    checks = {c.name: c for c in evaluate(document)}
    assert set(checks) == set(TARGET_NAMES)
    premium = document["policies"]["kvquota"]["tiers"]["premium"]["ttftP99"]
    base = document["comparison"]["baselineTtftP99"]
    assert checks["p99/base"].value == f"{premium / base:.2f}x"
    assert checks["p99/base"].passed is (premium / base <= 1.5)
    assert checks["in-guar"].value == "0" and checks["in-guar"].passed


def test_a_missed_target_fails_the_case_and_says_why(document: dict[str, Any]) -> None:
    worse = {**document, "comparison": {**document["comparison"],
                                        "ttftP99VsBaseline": {"kvquota": 9.0}}}
    case = CaseResult("tiny", "default", worse, evaluate(worse))
    assert not case.passed
    table = format_suite([case])
    assert "9.00x FAIL" in table and "0/1 cases meet every target" in table
    assert "tiny@default: p99/base 9.00x" in table and "prefix hit" in table
    assert "**FAIL**" in format_markdown([case])


def test_the_suite_covers_every_shipped_scenario_at_both_scales() -> None:
    cases = suite_cases()
    names = {name for name, _ in cases}
    assert {"noisy-neighbour", "premium-idle-burst", "all-premium-saturation",
            "steady-mixed", "premium-self-burst", "tiered-rag"} <= names
    assert all((name, "a100-40gb") in cases and (name, None) in cases for name in names)


def _slower(document: dict[str, Any], steps: float) -> dict[str, Any]:
    """`document` with KVQuota taking `steps` of its own mean steps longer than stock
    FCFS for the same output tokens."""
    policies = document["policies"]
    ours, fcfs = policies["kvquota"], policies["fcfs"]
    step = ours["makespan"] / ours["steps"]
    makespan = fcfs["makespan"] + steps * step
    ours = {**ours, "makespan": makespan, "outputTokens": fcfs["outputTokens"],
            "throughput": fcfs["outputTokens"] / makespan}
    return {**document, "policies": {**policies, "kvquota": ours}}


def test_a_difference_under_one_twin_step_is_a_tie_and_more_is_a_miss(
    document: dict[str, Any],
) -> None:
    tie = {c.name: c for c in evaluate(_slower(document, 0.5))}["tput"]
    assert tie.passed and tie.tie and "under one step" in tie.detail
    assert "TIE" in format_suite([CaseResult("tiny", "default", document, [tie])])
    miss = {c.name: c for c in evaluate(_slower(document, 2.0))}["tput"]
    assert miss.passed is False and not miss.tie
