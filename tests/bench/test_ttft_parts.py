"""Where a turn's TTFT went: the ledger's accounting on steps whose answer is known, and
the tail split against the same turns alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvquota_lab.bench.cost import CostProfile, load_profile
from kvquota_lab.bench.metrics import Outcome
from kvquota_lab.bench.policies import POLICIES
from kvquota_lab.bench.scenario import generate_sessions, load_scenario
from kvquota_lab.bench.ttft_parts import CAUSES, TtftLedger, TtftParts, describe, tail_split
from kvquota_lab.bench.twin import run_twin
from kvquota_lab.twin.harness import StepRecord

# 10 ms a step, 1 ms a prompt token, 2 ms a decoding sequence, attention free.
PROFILE = CostProfile(name="test", overhead=0.01, prefill_per_token=0.001,
                      decode_per_seq=0.002, attention_per_context_token=0.0)
TIERS = {"p": "premium", "q": "premium", "f": "free", "d": "free"}


def _step(index: int, start: float, scheduled: dict[str, tuple[int, int]], *,
          decode: tuple[str, ...] = (), admitted: tuple[str, ...] = (),
          preempted: tuple[str, ...] = (), first: tuple[str, ...] = ()) -> StepRecord:
    """`scheduled`: request -> (tokens, KV length after the step)."""
    prefill = sum(n for r, (n, _) in scheduled.items() if r not in decode)
    record = StepRecord(
        index=index, start_time=start,
        num_scheduled_tokens={r: n for r, (n, _) in scheduled.items()},
        num_prefill_tokens=prefill, num_decode_tokens=len(decode),
        num_prefill_seqs=len(scheduled) - len(decode), num_decode_seqs=len(decode),
        num_context_tokens=sum(c for _, c in scheduled.values()),
        admitted_req_ids=list(admitted), preempted_req_ids=list(preempted),
        finished_req_ids=[], num_free_blocks=0, schedule_seconds=0.0, update_seconds=0.0,
        context_by_req={r: c for r, (_, c) in scheduled.items()},
        decode_req_ids=frozenset(decode), first_token_req_ids=list(first),
    )
    record.duration = PROFILE(record)
    return record


def test_a_turn_preempted_mid_prefill_is_split_into_known_parts() -> None:
    """Premium turn p: sent at 0, 0.5 s in the sidecar, admitted at 0.6 beside a free
    prefill of 300 tokens and a free decode; preempted for one step; back with 150
    tokens (its first 100 again, 50 new) beside another premium prefill of 50."""
    ledger = TtftLedger(PROFILE, max_num_batched_tokens=400, max_num_seqs=4)
    ledger.entered("p", "premium", arrival=0.0, sidecar=0.5)
    steps = [
        _step(0, 0.6, {"p": (100, 100), "f": (300, 300), "d": (1, 50)}, decode=("d",),
              admitted=("p", "f")),
        _step(1, 1.012, {"f": (200, 500)}, preempted=("p",)),
        _step(2, 1.222, {"p": (150, 150), "q": (50, 50)}, first=("p",)),
    ]
    assert [s.duration for s in steps] == pytest.approx([0.412, 0.21, 0.21])
    for record in steps:
        ledger.step(record, TIERS)
    parts = ledger.take("p")
    assert parts is not None
    assert parts.sidecar == pytest.approx(0.5)
    assert parts.engine_queue == pytest.approx(0.1)  # forwarded at 0.5, scheduled at 0.6
    assert parts.own == pytest.approx(0.15)  # 150 distinct prompt tokens
    assert parts.recompute == pytest.approx(0.1)  # the first 100, computed again
    assert parts.preempted == pytest.approx(0.21)  # the whole step it waited again
    assert parts.other_tiers == pytest.approx(0.3)  # free's 300 prompt tokens beside it
    assert parts.same_tier == pytest.approx(0.05)  # q's 50
    assert parts.batch == pytest.approx(0.01 + 0.002 + 0.01)  # overheads and d's decode
    assert parts.total == pytest.approx(1.432)  # its first token, sent at 0
    assert parts.causes()["preemption"] == pytest.approx(0.31)
    assert ledger.take("p") is None
    assert parts.queue_by == pytest.approx({"inProgress": 0.1, "blocks": 0.0})


def test_engine_queue_time_says_why_the_engine_left_the_turn_waiting() -> None:
    """Sent at 0.05 into a step that ends at 0.1; then a step whose 400-token budget
    went to a running free prefill, one with all 4 seats taken, one with room it
    could not get (no blocks)."""
    ledger = TtftLedger(PROFILE, max_num_batched_tokens=400, max_num_seqs=4)
    ledger.entered("p", "premium", arrival=0.0, sidecar=0.05)
    steps = [
        _step(0, 0.1, {"f": (400, 400)}),
        _step(1, 0.51, {"d": (1, 10), "f": (1, 401), "q": (1, 51), "x": (1, 11)},
              decode=("d", "f", "q", "x")),
        _step(2, 0.528, {"f": (1, 402)}, decode=("f",)),
        _step(3, 0.54, {"p": (10, 10)}, admitted=("p",), first=("p",)),
    ]
    for record in steps:
        ledger.step(record, TIERS)
    parts = ledger.take("p")
    assert parts is not None
    assert parts.engine_queue == pytest.approx(0.54 - 0.05)
    assert parts.queue_by == pytest.approx(
        {"inProgress": 0.05, "tokenBudget": 0.41, "seats": 0.018, "blocks": 0.012})
    assert parts.total == pytest.approx(0.56)


def test_a_running_turn_left_out_of_a_step_pays_what_the_step_computed() -> None:
    """A step whose token budget went to others: their prompt tokens, by tier."""
    ledger = TtftLedger(PROFILE, max_num_batched_tokens=400, max_num_seqs=4)
    ledger.entered("p", "premium", arrival=1.0, sidecar=0.0)
    steps = [
        _step(0, 1.0, {"p": (10, 10)}, admitted=("p",)),
        _step(1, 1.02, {"f": (80, 80), "q": (20, 20)}),
        _step(2, 1.13, {"p": (10, 20)}, first=("p",)),
    ]
    for record in steps:
        ledger.step(record, TIERS)
    parts = ledger.take("p")
    assert parts is not None
    assert (parts.own, parts.recompute, parts.other_tiers, parts.same_tier) == pytest.approx(
        (0.02, 0.0, 0.08, 0.02))
    assert parts.batch == pytest.approx(0.03)
    assert parts.total == pytest.approx(1.15 - 1.0)


def _turn(session: str, ttft: float, parts: TtftParts | None) -> Outcome:
    outcome = Outcome("acme", "premium", session, 1, arrival=0.0, first_token=ttft,
                      status="ok")
    outcome.ttft_parts = parts
    return outcome


def test_the_tail_is_split_against_the_same_turns_alone() -> None:
    alone = [_turn("a", 0.3, TtftParts(engine_queue=0.1, own=0.2)),
             _turn("b", 0.4, TtftParts(engine_queue=0.1, own=0.2, batch=0.1))]
    shared = [
        # 0.9 s: 0.3 more interference, 0.1 more queue, 0.2 more own (a prefix lost).
        _turn("a", 0.9, TtftParts(engine_queue=0.2, own=0.4, other_tiers=0.3)),
        # 1.0 s: 0.5 in the sidecar, 0.1 recomputed after a preemption.
        _turn("b", 1.0, TtftParts(sidecar=0.5, engine_queue=0.1, own=0.2, recompute=0.1,
                                  batch=0.1)),
        _turn("c", 0.35, TtftParts(own=0.35)),  # under the threshold: not in the tail
    ]
    shared[0].ttft_parts.queue_by = {"tokenBudget": 0.2}  # type: ignore[union-attr]
    alone[0].ttft_parts.queue_by = {"tokenBudget": 0.1}  # type: ignore[union-attr]
    split = tail_split(shared, alone, "premium", threshold=0.4)
    assert split is not None
    assert split["engineQueueBy"] == pytest.approx(
        {"tokenBudget": 0.1, "seats": 0.0, "blocks": 0.0, "inProgress": 0.0})
    assert split["turns"] == 2 and split["unmatched"] == 0
    assert split["excessSeconds"] == pytest.approx(0.5 + 0.6)
    assert split["seconds"] == pytest.approx({
        "sidecar": 0.5, "engineQueue": 0.1, "interference": 0.3, "preemption": 0.1,
        "prefixMiss": 0.2, "other": 0.0})
    assert split["overAloneSeconds"] == pytest.approx((0.9 - 0.3) + (1.0 - 0.4))
    assert split["dominant"] == "sidecar"
    line = describe(split)
    assert line.startswith("2 turns over the baseline p99 by 1.10 s (1.20 s over the same")
    assert "sidecar 0.50 s (42%), interference 0.30 s (25%)" in line
    assert "engineQueue 0.10 s (8%, tokenBudget 0.10 s)" in line


def test_a_turn_missing_from_the_baseline_counts_whole_and_no_parts_means_no_split(
) -> None:
    split = tail_split([_turn("x", 1.0, TtftParts(engine_queue=1.0))], [], "premium", 0.5)
    assert split is not None and split["unmatched"] == 1
    assert split["seconds"]["engineQueue"] == pytest.approx(1.0)
    assert tail_split([_turn("x", 1.0, None)], [], "premium", 0.5) is None


def test_every_twin_turn_s_parts_sum_to_its_ttft(tiny_scenario: Path) -> None:
    scenario = load_scenario(str(tiny_scenario))
    result = run_twin(scenario, generate_sessions(scenario), POLICIES["kvquota"],
                      load_profile(scenario.profile))
    done = [o for o in result.outcomes if o.status == "ok"]
    assert done and all(o.ttft_parts is not None for o in done)
    for outcome in done:
        assert outcome.ttft_parts is not None and outcome.ttft is not None
        assert outcome.ttft_parts.total == pytest.approx(outcome.ttft, abs=1e-9)
        assert min(outcome.ttft_parts.causes().values()) >= -1e-9
    assert set(CAUSES) == set(done[0].ttft_parts.causes())  # type: ignore[union-attr]
