"""Admission decisions, the pool view they read and the reservation ledger (pure)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.rules import (
    Decision,
    PoolView,
    RequestShape,
    Verdict,
    blocks_for,
    decide,
    pool_view,
)
from engine_sidecar.gateway.counting.prefix import prompt_fingerprints

from .helpers import make_policy, tenant

BLOCK = 32


_fresh = itertools.count(1)


def _prompt(tokens: int) -> list[int]:
    """A prompt that shares no block with any other (a fresh first token)."""
    return [16 + next(_fresh) % 30_000] + [17] * (tokens - 1)


def _shape(tokens: list[int], max_tokens: int | None, n: int = 1,
           session: str | None = None) -> RequestShape:
    return RequestShape((len(tokens),), max_tokens, n, session=session,
                        prefix=prompt_fingerprints([tokens], BLOCK))


def _decide(
    policy: TenantPolicy, prompt: int | list[int] = 10, max_tokens: int | None = None, *,
    view: PoolView | None = None, n: int = 1, max_model_len: int | None = 2048,
    watermark: float = 0.1, session: str | None = None,
) -> Verdict:
    view = view or pool_view(make_policy(policy), None, Ledger())
    tokens = _prompt(prompt) if isinstance(prompt, int) else prompt
    return decide(policy, _shape(tokens, max_tokens, n, session),
                  block_size=BLOCK, watermark=watermark, view=view,
                  max_model_len=max_model_len)


def _stats(total: int, free: int, **tenants: TenantEngineStats) -> EngineStats:
    return EngineStats(timestamp=0, total_blocks=total, free_blocks=free, tenants=tenants)


def _view(policy: EnginePolicy, stats: EngineStats | None, ledger: Ledger | None = None
          ) -> PoolView:
    return pool_view(policy, stats, ledger or Ledger())


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
    assert not verdict.waits
    too_long = _decide(tenant("acme"), 2048)
    assert too_long.error is not None and too_long.error.code == "PROMPT_TOO_LONG"


def test_quota_and_concurrency_wait_as_429() -> None:
    acme = tenant("acme", max_blocks_per_engine=10, max_concurrent_requests=2)
    policy = make_policy(acme)
    ledger = Ledger()
    ledger.reserve("acme", 9)
    fits = _decide(acme, 10, 20, view=_view(policy, None, ledger))  # 1 block: 9 + 1 fits
    assert fits.admitted
    over = _decide(acme, 10, 60, view=_view(policy, None, ledger))  # 3 blocks: 12 > 10
    assert over.error is not None and over.decision is Decision.REJECTED_QUOTA and over.waits
    assert (over.error.status, over.error.code) == (429, "TENANT_BLOCK_QUOTA_EXHAUSTED")
    ledger.reserve("acme", 0)
    busy = _decide(acme, 10, 20, view=_view(policy, None, ledger))
    assert busy.error is not None and busy.decision is Decision.REJECTED_CONCURRENCY
    assert (busy.error.status, busy.error.code) == (429, "TENANT_CONCURRENCY_EXHAUSTED")


def test_a_request_larger_than_the_whole_quota_is_400_not_429() -> None:
    verdict = _decide(tenant("acme", max_blocks_per_engine=2), 10, 100)
    assert verdict.error is not None and not verdict.waits
    assert (verdict.error.status, verdict.error.code) == (400, "REQUEST_EXCEEDS_TENANT_QUOTA")


def test_a_request_no_state_of_the_engine_could_admit_is_400_at_once() -> None:
    """Issue 46's numbers: a 640-block engine, watermark 0.15 (96 kept), a tenant without
    guarantee asking n=10 x (10 + 1900) tokens = 600 blocks of 32: within its maxBlocks,
    but a borrower can never get more than the 544 above the watermark."""
    free = tenant("free", guaranteed_blocks=0, max_blocks_per_engine=600, max_tokens=4096)
    paid = tenant("paid", guaranteed_blocks=600, max_blocks_per_engine=700, max_tokens=4096)
    policy = make_policy(free, paid)
    empty = _view(policy, _stats(640, 640))
    never = _decide(free, 10, 1900, n=10, view=empty, watermark=0.15)
    assert never.error is not None and not never.waits
    assert (never.error.status, never.error.code, never.error.param) == (
        400, "REQUEST_EXCEEDS_ENGINE_CAPACITY", "max_tokens")
    assert "600 new KV blocks" in never.error.message
    assert "at most the 544 of the engine's 640 blocks above its 0.15 watermark" in (
        never.error.message)
    # 544 blocks fit an empty engine: n=8 x 1900 is 480.
    assert _decide(free, 10, 1900, n=8, view=empty, watermark=0.15).admitted
    # Within a guarantee the watermark never refuses; the engine's size still binds.
    assert _decide(paid, 10, 1900, n=10, view=empty, watermark=0.15).admitted
    too_big = _decide(paid, 10, 2000, n=11, view=empty, watermark=0.15)  # 693 blocks
    assert too_big.error is not None and too_big.error.code == (
        "REQUEST_EXCEEDS_ENGINE_CAPACITY") and "holds 640 KV blocks in all" in (
        too_big.error.message)
    # A full engine: the same request that fits an empty one waits (503), not 400.
    full = _view(policy, _stats(640, 0))
    assert _decide(free, 10, 1900, n=8, view=full, watermark=0.15).waits
    # Unknown capacity: nothing to compare with.
    assert _decide(free, 10, 1900, n=10, view=_view(policy, None), watermark=0.15).admitted


def test_watermark_refuses_borrowers_only() -> None:
    borrower = tenant("free", guaranteed_blocks=0, max_blocks_per_engine=50)
    guaranteed = tenant("premium", guaranteed_blocks=20, max_blocks_per_engine=50)
    policy = make_policy(borrower, guaranteed)
    nearly_full = _view(policy, _stats(100, 12))  # the floor keeps 10 free
    refused = _decide(borrower, 10, 86, view=nearly_full)  # 3 blocks: 12 - 3 < 10
    assert refused.error is not None and refused.decision is Decision.REJECTED_WATERMARK
    assert (refused.error.status, refused.error.code) == (503, "KV_CACHE_WATERMARK_EXCEEDED")
    assert refused.borrowing and refused.waits
    assert _decide(borrower, 10, 54, view=nearly_full).admitted  # 2 blocks: 10 >= 10
    assert _decide(guaranteed, 10, 600, view=_view(policy, _stats(100, 0))).admitted
    assert _decide(borrower, 10, 86, view=_view(policy, None)).admitted  # capacity unknown


def test_a_borrower_within_its_pool_wide_guarantee_may_take_the_watermarks_room() -> None:
    """The pool-wide ledger vouches that the tenant stays within its pool-wide guarantee
    (`pool_guarantee`): a borrower here may use the free blocks the watermark keeps, no
    more (and what is reclaimable from lower classes, as any borrower)."""
    borrower = tenant("free", guaranteed_blocks=0, max_blocks_per_engine=50, max_tokens=4096)
    view = _view(make_policy(borrower), _stats(100, 12))  # the floor keeps 10 free

    def run(max_tokens: int, pool_guarantee: bool) -> Verdict:
        return decide(borrower, _shape(_prompt(10), max_tokens), block_size=BLOCK,
                      watermark=0.1, view=view, max_model_len=2048,
                      pool_guarantee=pool_guarantee)

    assert run(86, False).decision is Decision.REJECTED_WATERMARK  # 3 blocks: 12 - 3 < 10
    within = run(86, True)
    assert within.admitted and within.borrowing  # still the first its class gives back
    assert run(374, True).admitted  # 12 blocks: every free block
    too_big = run(406, True)  # 13 blocks: more than the engine has free
    assert too_big.decision is Decision.REJECTED_WATERMARK and too_big.waits


def test_a_premium_borrower_counts_what_lower_borrowers_would_give_back() -> None:
    """The rule that agrees with preemption: the free tenant's blocks above its guarantee
    are reclaimable for premium, not for the free tenant itself."""
    premium = tenant("acme", tier="premium", priority=0, guaranteed_blocks=20,
                     max_blocks_per_engine=90,
                     max_tokens=4096)
    free = tenant("hobby", tier="free", priority=2, guaranteed_blocks=5, max_blocks_per_engine=60,
                  max_tokens=4096)
    policy = make_policy(premium, free)
    ledger = Ledger()
    ledger.reserve("acme", 20)  # at its guarantee: the next block borrows
    ledger.reserve("hobby", 50)
    stats = _stats(100, 12, acme=TenantEngineStats(running_blocks=20),
                   hobby=TenantEngineStats(running_blocks=50))
    view = _view(policy, stats, ledger)
    # 2 blocks above the floor + the 45 the free tenant borrows beyond its 5 = 47.
    assert _decide(premium, 10, 47 * BLOCK - 10, view=view).admitted  # 47 blocks
    assert _decide(premium, 10, 48 * BLOCK - 10, view=view).decision is (
        Decision.REJECTED_WATERMARK
    )
    # The free tenant itself may only take the 2 above the floor.
    assert _decide(free, 10, 2 * BLOCK - 10, view=view).admitted
    assert _decide(free, 10, 3 * BLOCK - 10, view=view).decision is Decision.REJECTED_WATERMARK


def test_idle_tenants_change_no_decision_and_stay_out_of_the_view() -> None:
    """A policy of hundreds of tenants, most idle: the same decisions as without them,
    and the view (rebuilt on every reservation) holds only the tenants that hold
    something, in the ledger or in the engine (a lease without a request in flight)."""
    premium = tenant("acme", tier="premium", priority=0, guaranteed_blocks=20,
                     max_blocks_per_engine=90,
                     max_tokens=4096)
    free = tenant("hobby", tier="free", priority=2, guaranteed_blocks=5, max_blocks_per_engine=60,
                  max_tokens=4096)
    leased = tenant("lessee", tier="free", priority=2, guaranteed_blocks=0,
                    max_blocks_per_engine=60)
    idle = [tenant(f"idle-{i}", tier="free", priority=2,
                   max_blocks_per_engine=60) for i in range(300)]
    ledger = Ledger()
    ledger.reserve("acme", 20)
    ledger.reserve("hobby", 50)
    busy = {"acme": TenantEngineStats(running_blocks=20),
            "hobby": TenantEngineStats(running_blocks=40),
            "lessee": TenantEngineStats(leased_blocks=8, pinned_blocks=8, leases={"s": 8})}
    small = _view(make_policy(premium, free, leased), _stats(100, 4, **busy), ledger)
    crowded_stats = _stats(100, 4, **busy, **{t.tenant_id: TenantEngineStats() for t in idle})
    crowded = _view(make_policy(premium, free, leased, *idle), crowded_stats, ledger)
    assert set(crowded.tenants or {}) == {"acme", "hobby", "lessee"}
    for requester in (premium, free, leased, idle[0]):
        for blocks in (1, 10, 40, 48, 49, 60):
            mine, theirs = (_decide(requester, 10, blocks * BLOCK - 10, view=view)
                            for view in (small, crowded))
            assert (mine.decision, mine.blocks) == (theirs.decision, theirs.blocks)
    # The tenant whose only holding is an idle lease is in the view, and its 8 blocks
    # are reclaimable for premium: without the lease premium may borrow 8 fewer.
    unleased = _view(make_policy(premium, free, leased, *idle),
                     _stats(100, 4, **{**busy, "lessee": TenantEngineStats()}), ledger)

    def most(view: PoolView) -> int:
        return max(b for b in range(1, 90)
                   if _decide(premium, 10, b * BLOCK - 10, view=view).admitted)

    assert most(crowded) == most(unleased) + 8


def test_a_borrower_of_the_same_tier_is_not_reclaimable_but_its_idle_leases_are() -> None:
    a = tenant("a", guaranteed_blocks=10, max_blocks_per_engine=90)
    b = tenant("b", guaranteed_blocks=10, max_blocks_per_engine=90)
    policy = make_policy(a, b)
    ledger = Ledger()
    ledger.reserve("a", 10)
    running = _view(policy, _stats(100, 10, a=TenantEngineStats(running_blocks=10),
                                   b=TenantEngineStats(running_blocks=80)), ledger)
    assert _decide(a, 10, 300, view=running).decision is Decision.REJECTED_WATERMARK
    leased = _view(policy, _stats(100, 10, a=TenantEngineStats(running_blocks=10),
                                  b=TenantEngineStats(running_blocks=10, leased_blocks=70,
                                                      pinned_blocks=70, leases={"s": 70})),
                   ledger)
    assert _decide(a, 10, 300, view=leased).admitted


def test_a_follow_up_turn_does_not_pay_twice_for_its_leased_prefix() -> None:
    acme = tenant("acme", guaranteed_blocks=0, max_blocks_per_engine=20, max_tokens=64)
    policy = make_policy(acme)
    stats = _stats(1000, 900, acme=TenantEngineStats(leased_blocks=12, pinned_blocks=12,
                                                      leases={"chat-1": 12}))
    view = _view(policy, stats)
    # 14 blocks in all, 12 of them the session's own pinned prefix: the engine allocates
    # 2, and the tenant's usage counts the 14 once (12 + 14 would pass its 20).
    follow_up = _decide(acme, 14 * BLOCK - 32, 32, view=view, session="chat-1")
    assert follow_up.admitted and (follow_up.new_blocks, follow_up.blocks) == (2, 14)
    # Another session of the tenant pays in full, and the idle lease does not count
    # against the quota (it yields to the tenant's own new work).
    other = _decide(acme, 14 * BLOCK - 32, 32, view=view, session="chat-2")
    assert other.admitted and other.new_blocks == other.blocks == 14


def test_a_prefix_the_tenants_requests_share_is_reserved_once() -> None:
    acme = tenant("acme", guaranteed_blocks=0, max_blocks_per_engine=30, max_tokens=64)
    policy = make_policy(acme)
    system = _prompt(10 * BLOCK)  # a 10-block system prompt
    ledger = Ledger()
    first = _decide(acme, system + [18] * (4 * BLOCK), 32, view=_view(policy, None, ledger))
    # 14 prompt blocks, all full (extra 0), and one block of output still to come.
    assert (first.blocks, first.extra, first.remainder.bound) == (15, 0, 1)
    ledger.reserve("acme", first.extra, None, prompt_fingerprints([system + [18] * 128], BLOCK),
                   first.remainder)
    # The second request shares the 10 system blocks: it adds its own 4 + 1.
    second = _decide(acme, system + [19] * (4 * BLOCK), 32, view=_view(policy, None, ledger))
    assert second.admitted and second.blocks == 5
    assert ledger.reserved_blocks("acme") == 15
    # A third of the same size would pass the quota of 30 only because of the sharing.
    assert _decide(acme, system + [20] * (4 * BLOCK), 32,
                   view=_view(policy, None, ledger)).admitted


def test_the_pool_view_counts_growth_still_to_be_allocated_once() -> None:
    policy = make_policy(tenant("a"))
    ledger = Ledger()
    ledger.reserve("a", 150)
    stats = _stats(1000, 900, a=TenantEngineStats(running_blocks=60),
                   **{UNCLASSIFIED: TenantEngineStats(running_blocks=40)})
    # 100 used in the engine; 60 of them by requests that reserved 150: 90 to come.
    view = _view(policy, stats, ledger)
    assert (view.total_blocks, view.free_blocks, view.source) == (1000, 810, "engine")
    assert view.unclassified == 40
    capped = _view(make_policy(tenant("a"), capacity_blocks=500), stats, ledger)
    assert (capped.total_blocks, capped.free_blocks, capped.source) == (500, 310, "policy")
    assert _view(make_policy(tenant("a"), capacity_blocks=500), None, ledger).free_blocks == 350
    assert not _view(policy, None, ledger).known


@settings(database=None)
@given(
    guaranteed=st.integers(0, 200), used=st.integers(0, 200), prompt=st.integers(1, 1500),
    max_tokens=st.integers(1, 500), free=st.integers(0, 1000), watermark=st.floats(0, 0.49),
    others=st.integers(0, 800),
)
def test_never_503_within_the_guaranteed_share(
    guaranteed: int, used: int, prompt: int, max_tokens: int, free: int, watermark: float,
    others: int,
) -> None:
    acme = tenant("acme", guaranteed_blocks=guaranteed, max_blocks_per_engine=10_000,
                  max_tokens=500)
    rival = tenant("rival", guaranteed_blocks=0, max_blocks_per_engine=10_000)
    policy = make_policy(acme, rival)
    ledger = Ledger()
    ledger.reserve("acme", used)
    stats = _stats(1000, free, acme=TenantEngineStats(running_blocks=used),
                   rival=TenantEngineStats(running_blocks=others))
    verdict = _decide(acme, prompt, max_tokens, view=_view(policy, stats, ledger),
                      watermark=watermark)
    if used + verdict.blocks <= guaranteed:
        assert verdict.admitted and not verdict.borrowing


@settings(max_examples=200, database=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 50),
                          st.sampled_from(["completed", "upstream_error", "timeout",
                                           "cancelled"]), st.integers(1, 3),
                          st.sampled_from([None, "s1", "s2"])),
                max_size=60))
def test_ledger_returns_to_zero_after_any_mix(
    events: list[tuple[str, int, str, int, str | None]]
) -> None:
    ledger = Ledger()
    held = [(ledger.reserve(t, blocks, session), outcome, repeats)
            for t, blocks, outcome, repeats, session in events]
    assert ledger.total_blocks == sum(blocks for _, blocks, _, _, _ in events)
    for reservation, outcome, repeats in reversed(held):
        released = [reservation.release(outcome) for _ in range(repeats)]
        assert released[0] and not any(released[1:])  # exactly once
    assert (ledger.total_blocks, ledger.total_inflight, ledger.tenants()) == (0, 0, [])
    assert all(not ledger.sessions(t) for t in "abc")
