"""Capacity, the per-replica split and oversubscription admission (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvquota.split.capacity import (
    admit_oldest_first,
    engine_capacity,
    guaranteeable_blocks,
    split_quota,
)


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 64))
def test_split_never_promises_more_than_the_pool_guarantees(g: int, extra: int, n: int) -> None:
    maximum = g + extra
    split = split_quota(g, maximum, n)
    assert split.guaranteed * n <= g  # replicas together never over-guarantee
    assert split.maximum * n >= maximum  # the pool can still serve the whole ceiling
    assert split.maximum >= split.guaranteed


def test_split_rounds_guaranteed_down_and_maximum_up() -> None:
    split = split_quota(100, 250, 3)
    assert (split.guaranteed, split.maximum) == (33, 84)
    # No ready engine yet: the policy is written for one replica.
    assert split_quota(100, 250, 0).guaranteed == 100


def test_capacity_is_the_override_else_the_smallest_ready_engine() -> None:
    assert engine_capacity(640, [100, 200]) == 640
    assert engine_capacity(None, [900, 700, 0]) == 700  # 0: engine not reporting yet
    assert engine_capacity(None, []) is None


def test_watermark_stays_free_for_borrowing() -> None:
    assert guaranteeable_blocks(1000, 2, 0.15) == 1700


def test_newest_quotas_that_do_not_fit_are_refused_older_keep_theirs() -> None:
    decisions = admit_oldest_first([("old", 500), ("mid", 300), ("new", 200)], budget=850)
    assert [decisions[k].accepted for k in ("old", "mid", "new")] == [True, True, False]
    assert decisions["new"].granted_before == 800


def test_a_newer_quota_waits_behind_an_older_one_that_does_not_fit() -> None:
    decisions = admit_oldest_first([("a", 500), ("big", 600), ("small", 100)], budget=850)
    assert decisions["big"].accepted is False
    assert decisions["small"].accepted is False
    assert decisions["small"].waiting_behind == "big"


def test_quota_without_guarantee_is_always_accepted() -> None:
    decisions = admit_oldest_first([("a", 900), ("free", 0)], budget=850)
    assert decisions["free"].accepted is True


@given(st.lists(st.integers(0, 500), max_size=12), st.integers(0, 3000), st.integers(0, 3000))
def test_more_capacity_never_takes_a_guarantee_away(
    sizes: list[int], budget: int, more: int
) -> None:
    requests = [(i, size) for i, size in enumerate(sizes)]
    small = admit_oldest_first(requests, budget)
    large = admit_oldest_first(requests, budget + more)
    assert all(large[k].accepted for k, d in small.items() if d.accepted)


@given(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.integers(0, 3000))
def test_accepted_guarantees_fit_the_budget(sizes: list[int], budget: int) -> None:
    decisions = admit_oldest_first(list(enumerate(sizes)), budget)
    assert sum(size for i, size in enumerate(sizes) if decisions[i].accepted) <= budget
