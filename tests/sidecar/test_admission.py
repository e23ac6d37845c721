"""Admission decisions and the reservation ledger, as pure functions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.gateway.admission import (
    UNKNOWN_CAPACITY,
    Capacity,
    Decision,
    RequestShape,
    TenantLoad,
    Verdict,
    blocks_for,
    capacity_view,
    decide,
)
from engine_sidecar.gateway.ledger import Ledger
from engine_sidecar.policy import TenantPolicy
from engine_sidecar.stats import EngineStats, TenantEngineStats

from .helpers import tenant

IDLE = TenantLoad(reserved_blocks=0, leased_blocks=0, inflight=0)


def _decide(
    policy: TenantPolicy, prompt: int = 10, max_tokens: int | None = None, *,
    load: TenantLoad = IDLE, capacity: Capacity = UNKNOWN_CAPACITY, n: int = 1,
    max_model_len: int | None = 2048, watermark: float = 0.1,
) -> Verdict:
    return decide(policy, RequestShape((prompt,), max_tokens, n), block_size=32,
                  watermark=watermark, load=load, capacity=capacity,
                  max_model_len=max_model_len, retry_after=2)


def test_max_tokens_is_clamped_or_defaulted_and_sizes_the_reservation() -> None:
    policy = tenant("acme", max_tokens=100, default_max_tokens=40)
    assert (_decide(policy, 10, 5000).max_tokens, _decide(policy, 10, 5000).blocks) == (100, 4)
    assert (_decide(policy, 10, 20).max_tokens, _decide(policy, 10, 20).blocks) == (20, 1)
    assert (_decide(policy, 10).max_tokens, _decide(policy, 10).blocks) == (40, 2)
    # A default never pushes past the model's context.
    assert _decide(policy, 2030).max_tokens == 18


def test_blocks_are_per_prompt_and_per_sequence() -> None:
    shape = RequestShape((31, 1), None, n=3)
    assert blocks_for(shape, 1, 32) == 3 * 1 + 3 * 1
    assert blocks_for(shape, 2, 32) == 3 * 2 + 3 * 1


def test_prompt_limits_are_400() -> None:
    verdict = _decide(tenant("acme", max_prompt_tokens=50), 51)
    assert verdict.decision is Decision.REJECTED_PROMPT and verdict.error is not None
    assert (verdict.error.status, verdict.error.code) == (400, "PROMPT_TOO_LONG")
    too_long = _decide(tenant("acme"), 2048)
    assert too_long.error is not None and too_long.error.code == "PROMPT_TOO_LONG"


def test_quota_and_concurrency_are_429_with_retry_after() -> None:
    policy = tenant("acme", max_blocks=10, max_concurrent_requests=2)
    quota = _decide(policy, 10, 20, load=TenantLoad(5, 4, 1))  # 1 block: 5 + 4 + 1 fits
    assert quota.admitted
    over = _decide(policy, 10, 60, load=TenantLoad(5, 4, 1))  # 3 blocks: 12 > 10
    assert over.error is not None and over.decision is Decision.REJECTED_QUOTA
    assert (over.error.status, over.error.code, over.error.retry_after) == \
        (429, "TENANT_BLOCK_QUOTA_EXHAUSTED", 2)
    busy = _decide(policy, 10, 20, load=TenantLoad(0, 0, 2))
    assert busy.error is not None and busy.decision is Decision.REJECTED_CONCURRENCY
    assert (busy.error.status, busy.error.code) == (429, "TENANT_CONCURRENCY_EXHAUSTED")


def test_a_request_larger_than_the_whole_quota_is_400_not_429() -> None:
    verdict = _decide(tenant("acme", max_blocks=2), 10, 100)
    assert verdict.error is not None
    assert (verdict.error.status, verdict.error.code) == (400, "REQUEST_EXCEEDS_TENANT_QUOTA")


def test_watermark_refuses_borrowers_only() -> None:
    nearly_full = Capacity(total_blocks=100, free_blocks=12, source="engine")
    borrower = tenant("free", guaranteed_blocks=0, max_blocks=50)
    guaranteed = tenant("premium", guaranteed_blocks=20, max_blocks=50)
    refused = _decide(borrower, 10, 86, capacity=nearly_full)  # 3 blocks: 12 - 3 < 10
    assert refused.error is not None and refused.decision is Decision.REJECTED_WATERMARK
    assert (refused.error.status, refused.error.code) == (503, "KV_CACHE_WATERMARK_EXCEEDED")
    assert refused.error.retry_after == 2
    assert _decide(borrower, 10, 54, capacity=nearly_full).admitted  # 2 blocks: 10 >= 10
    assert _decide(guaranteed, 10, 600, capacity=Capacity(100, 0, "engine")).admitted
    assert _decide(borrower, 10, 86, capacity=UNKNOWN_CAPACITY).admitted


@settings(database=None)
@given(
    guaranteed=st.integers(0, 200), used=st.integers(0, 200), prompt=st.integers(1, 1500),
    max_tokens=st.integers(1, 500), free=st.integers(0, 1000), watermark=st.floats(0, 0.49),
)
def test_never_503_within_the_guaranteed_share(
    guaranteed: int, used: int, prompt: int, max_tokens: int, free: int, watermark: float
) -> None:
    policy = tenant("acme", guaranteed_blocks=guaranteed, max_blocks=10_000, max_tokens=500)
    verdict = _decide(policy, prompt, max_tokens, load=TenantLoad(used, 0, 0),
                      capacity=Capacity(1000, free, "engine"), watermark=watermark)
    if used + verdict.blocks <= guaranteed:
        assert verdict.decision is not Decision.REJECTED_WATERMARK


def test_capacity_view_counts_unallocated_reservations_once() -> None:
    stats = EngineStats(timestamp=0, total_blocks=1000, free_blocks=900,
                        tenants={"a": TenantEngineStats(running_blocks=60)})
    # 100 used in the engine, 60 of them by running requests that hold 150 reserved.
    view = capacity_view(None, stats, reserved_total=150)
    assert (view.total_blocks, view.free_blocks, view.source) == (1000, 810, "engine")
    assert capacity_view(500, stats, 150).free_blocks == 310  # override caps capacity
    assert capacity_view(500, None, 150) == Capacity(500, 350, "policy")
    assert capacity_view(None, None, 150) == UNKNOWN_CAPACITY


@settings(max_examples=200, database=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 50),
                          st.sampled_from(["completed", "upstream_error", "timeout",
                                           "cancelled"]), st.integers(1, 3)),
                max_size=60))
def test_ledger_returns_to_zero_after_any_mix(
    events: list[tuple[str, int, str, int]]
) -> None:
    ledger = Ledger()
    held = [(ledger.reserve(t, blocks), outcome, repeats) for t, blocks, outcome, repeats
            in events]
    assert ledger.total_blocks == sum(blocks for _, blocks, _, _ in events)
    for reservation, outcome, repeats in reversed(held):
        released = [reservation.release(outcome) for _ in range(repeats)]
        assert released[0] and not any(released[1:])  # exactly once
    assert (ledger.total_blocks, ledger.total_inflight, ledger.tenants()) == (0, 0, [])
