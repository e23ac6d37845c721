"""The demo's verdict: it names the mechanism when the run shows it, and the failing
measure instead of a ratio when the run could not show it. No engine: hand-built runs."""

from __future__ import annotations

from kvquota_lab.loadgen import Result
from kvquota_lab.summary import summarise
from kvquota_lab.verdict import POLICY_RUN, STOCK_RUN, judge

HELD = "12 requests waiting for KV, cache 99% full"
TURNS = 10


def _first_turns() -> list[Result]:
    return [Result("premium", "acme", 1, 0, 200, None, 0.08, 0.3, 0.0, prompt_tokens=300)
            for _ in range(TURNS)]


def _follow_ups(ttft: float, *, cached: int, sent_at: float = 10.0, held: str | None = HELD,
                lag: float = 0.002) -> list[Result]:
    return [Result("premium", "acme", 2, 1, 200, None, ttft, ttft + 0.2, sent_at,
                   prompt_tokens=372, cached_tokens=cached, held=held, engine_waiting=12,
                   client_lag=lag)
            for _ in range(TURNS)]


def _free(first_token_at: float, count: int = 12, *, status: int = 200) -> list[Result]:
    """Free requests sent before the follow-ups (at 9.5 s) with a first token at
    `first_token_at`."""
    ttft = first_token_at - 9.5 if status == 200 else None
    return [Result("free", "hobbyist", 0, 1, status, None, ttft, 1.0, 9.5) for _ in range(count)]


def _runs(on: list[Result], stock: list[Result]) -> dict[str, dict]:
    return {POLICY_RUN: summarise(on), STOCK_RUN: summarise(stock)}


def _kvquota_run() -> list[Result]:
    return [*_first_turns(), *_follow_ups(0.1, cached=320), *_free(9.7, 5),
            *_free(0, 40, status=429)]


def test_a_run_that_shows_the_effect_names_the_mechanisms_and_prints_the_ratio() -> None:
    # Stock: the follow-ups (sent at 10 s) were served after the free requests that had
    # queued before them (first tokens at 11 s), 1.5 s after they were sent.
    stock = [*_first_turns(), *_follow_ups(1.5, cached=0), *_free(11.0)]
    verdict = judge(_runs(_kvquota_run(), stock), expected_follow_ups=TURNS)
    text = "\n".join(verdict.lines())
    assert verdict.shown and verdict.protected, text
    assert verdict.ratio is not None and abs(verdict.ratio - 0.1 / 1.5) < 1e-9
    assert "86%" in text and "0% on stock" in text  # the leases kept the prefix
    assert "served after 12 of them" in text and "served after 0" in text  # queue order
    assert "free 40 x 429" in text and "premium 0" in text  # refusals by tier
    assert "0.07x of stock vLLM" in text


def test_stock_turns_that_did_not_queue_behind_the_burst_give_no_ratio() -> None:
    # The free requests got their tokens before the follow-ups were even sent: stock's
    # follow-ups met an engine the burst no longer held, so a ratio would mislead.
    stock = [*_first_turns(), *_follow_ups(0.12, cached=0), *_free(9.8)]
    verdict = judge(_runs(_kvquota_run(), stock), expected_follow_ups=TURNS)
    text = "\n".join(verdict.lines())
    assert not verdict.shown and verdict.ratio is None
    assert "did not wait behind the burst" in text
    assert "x of stock" not in text
    assert "86%" in text  # the mechanisms seen are still reported


def test_a_machine_too_busy_to_tell_is_named_by_its_measure() -> None:
    # The p99s differ by 1.4 s (0.1 s with KVQuota, 1.5 s on stock): a machine that
    # keeps the load generator itself from running for half that could make it, one
    # stall in the load generator and one in the sidecar.
    stock = [*_first_turns(), *_follow_ups(1.5, cached=0, lag=0.75), *_free(11.0)]
    verdict = judge(_runs(_kvquota_run(), stock), expected_follow_ups=TURNS)
    text = "\n".join(verdict.lines())
    assert not verdict.shown
    assert "woke up to 750 ms late" in text and "(100 ms with KVQuota, 1500 ms" in text
    quicker = [*_first_turns(), *_follow_ups(1.5, cached=0, lag=0.65), *_free(11.0)]
    assert judge(_runs(_kvquota_run(), quicker), expected_follow_ups=TURNS).shown


def test_turns_sent_without_the_burst_holding_the_cache_give_no_ratio() -> None:
    stock = [*_first_turns(), *_follow_ups(1.5, cached=0, held=None), *_free(11.0)]
    verdict = judge(_runs(_kvquota_run(), stock), expected_follow_ups=TURNS)
    text = "\n".join(verdict.lines())
    assert not verdict.shown
    assert "held the cache for 0 of 10 follow-ups" in text


def test_missing_answers_are_counted_not_hidden() -> None:
    on = [*_first_turns(), *_follow_ups(0.1, cached=320)[:7], *_free(9.7, 5)]
    stock = [*_first_turns(), *_follow_ups(1.5, cached=0), *_free(11.0)]
    verdict = judge(_runs(on, stock), expected_follow_ups=TURNS)
    assert not verdict.shown
    assert any("7 of 10 premium follow-ups answered" in p for p in verdict.problems)
