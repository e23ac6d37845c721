"""The admission queue (pure, virtual clock): wait instead of refusal, tier order, fair
sharing within a tier, deadlines with Retry-After from the drain rate."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

from engine_sidecar.contract.policy import TenantPolicy
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.admission.rules import Decision, RequestShape

from .helpers import make_policy, tenant

BLOCK = 32


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _shape(blocks: int, session: str | None = None) -> RequestShape:
    """A request that reserves exactly `blocks` blocks (prompt only, max_tokens 1)."""
    return RequestShape((blocks * BLOCK - 1,), 1, session=session)


def _queue(*tenants: TenantPolicy, stats: Callable[[], EngineStats | None] = lambda: None,
           **pool: object) -> tuple[AdmissionQueue, Clock, Ledger]:
    clock, ledger = Clock(), Ledger()
    queue = AdmissionQueue(ledger, clock=clock, rng=random.Random(1), stats=stats,
                           max_model_len=lambda: None)
    queue.set_policy(make_policy(*tenants, **pool))
    return queue, clock, ledger


def _t(name: str, **overrides: object) -> TenantPolicy:
    defaults: dict[str, object] = {"max_tokens": 4096, "max_queue_seconds": 30,
                                   "max_queued_requests": 100}
    return tenant(name, **{**defaults, **overrides})


def test_a_request_over_its_quota_waits_and_is_admitted_when_blocks_free() -> None:
    queue, clock, _ = _queue(_t("acme", max_blocks_per_engine=10))
    first = queue.submit("acme", _shape(8))
    second = queue.submit("acme", _shape(5))
    assert first.admitted and not second.settled
    assert second.verdict is not None and second.verdict.decision is Decision.REJECTED_QUOTA
    clock.now = 2.5
    assert first.reservation is not None
    first.reservation.release()
    assert queue.pump() == [second]
    assert second.admitted and second.waited == 2.5 and second.waited_on is (
        Decision.REJECTED_QUOTA)


def test_a_refusal_comes_at_the_deadline_with_what_it_waited_on() -> None:
    queue, clock, _ = _queue(_t("acme", max_blocks_per_engine=10, max_queue_seconds=5))
    queue.submit("acme", _shape(10))
    waiting = queue.submit("acme", _shape(4))
    clock.now = 4.9
    assert queue.pump() == [] and not waiting.settled
    clock.now = 5.0
    assert queue.pump() == [waiting]
    assert waiting.error is not None and not waiting.admitted
    assert (waiting.error.status, waiting.error.code) == (429, "TENANT_BLOCK_QUOTA_EXHAUSTED")
    assert waiting.error.retry_after is not None and waiting.error.retry_after >= 1


def test_zero_wait_bound_refuses_at_once() -> None:
    queue, _, _ = _queue(_t("acme", max_blocks_per_engine=10, max_queue_seconds=0))
    queue.submit("acme", _shape(10))
    refused = queue.submit("acme", _shape(1))
    assert refused.settled and refused.error is not None and refused.error.status == 429


def test_a_full_tenant_queue_refuses_at_once() -> None:
    queue, _, _ = _queue(_t("acme", max_blocks_per_engine=10, max_queued_requests=2))
    queue.submit("acme", _shape(10))
    waiting = [queue.submit("acme", _shape(1)) for _ in range(2)]
    third = queue.submit("acme", _shape(1))
    assert not any(t.settled for t in waiting)
    assert third.settled and third.error is not None and third.error.status == 429
    assert queue.depth("acme") == 2


def test_a_request_no_state_of_the_engine_could_admit_never_waits() -> None:
    """Behind a waiting request of its tenant, a request larger than the engine's room
    above the watermark (100 blocks, 10 kept) is refused for good at once: a 400 with the
    numbers, not a 503 after the tier's queue time."""
    full = EngineStats(timestamp=0, total_blocks=100, free_blocks=5)
    queue, _, _ = _queue(_t("free", guaranteed_blocks=0, max_blocks_per_engine=200),
                         stats=lambda: full)
    waiting = queue.submit("free", _shape(10))
    never = queue.submit("free", _shape(91))
    assert not waiting.settled and waiting.waited_on is Decision.REJECTED_WATERMARK
    assert never.settled and never.error is not None and never.error.retry_after is None
    assert (never.error.status, never.error.code) == (400, "REQUEST_EXCEEDS_ENGINE_CAPACITY")
    assert "at most the 90 of the engine's 100 blocks" in never.error.message
    assert queue.depth("free") == 1
    assert not queue.submit("free", _shape(90)).settled  # fits an emptier engine: waits


def test_a_client_that_leaves_the_queue_holds_nothing() -> None:
    queue, _, ledger = _queue(_t("acme", max_blocks_per_engine=10))
    holder = queue.submit("acme", _shape(10))
    waiting = queue.submit("acme", _shape(3))
    queue.cancel(waiting)
    assert queue.depth("acme") == 0 and waiting.settled and not waiting.admitted
    assert holder.reservation is not None
    holder.reservation.release()
    assert queue.pump() == [] and ledger.total_blocks == 0


def test_tiers_are_served_in_order_when_capacity_frees() -> None:
    premium = _t("acme", tier="premium", priority=0, max_blocks_per_engine=100)
    free = _t("hobby", tier="free", priority=2, max_blocks_per_engine=100)
    stats = {"now": EngineStats(timestamp=0, total_blocks=100, free_blocks=0)}
    queue, _, _ = _queue(premium, free, stats=lambda: stats["now"])
    capacity = make_policy(premium, free)
    queue.set_policy(capacity)
    # Nothing free and nothing reclaimable (no engine usage is attributed): both wait.
    free_first = queue.submit("hobby", _shape(6))
    premium_next = queue.submit("acme", _shape(6))
    assert not free_first.settled and not premium_next.settled
    stats["now"] = EngineStats(timestamp=1, total_blocks=100, free_blocks=16)  # floor 10
    settled = queue.pump()
    assert settled == [premium_next] and not free_first.settled


def test_fair_share_within_a_tier_follows_the_guarantees() -> None:
    """VTC: with both tenants backlogged and room for one request at a time, the tenant
    with three times the guarantee is admitted three times as often."""
    big = _t("big", guaranteed_blocks=3, max_blocks_per_engine=10_000)
    small = _t("small", guaranteed_blocks=1, max_blocks_per_engine=10_000)
    queue, _, _ = _queue(big, small, stats=lambda: EngineStats(
        timestamp=0, total_blocks=100, free_blocks=14))
    # 14 free, 10 kept by the watermark floor: room for one 4-block request at a time.
    queue.set_policy(make_policy(big, small))
    tickets = [queue.submit(name, _shape(4)) for _ in range(30) for name in ("big", "small")]
    running = [t for t in tickets if t.admitted]
    assert len(running) == 1
    admitted: Counter[str] = Counter()
    for _ in range(40):
        done = running.pop(0)
        assert done.reservation is not None
        done.reservation.release()
        (next_one,) = queue.pump()
        admitted[next_one.tenant_id] += 1
        running.append(next_one)
    # 3:1 over the run. The small tenant is one admission ahead: the first request was
    # admitted before it had joined the backlog, so it was not lifted to that count.
    assert admitted == {"big": 29, "small": 11}


def test_a_request_within_its_guarantee_does_not_wait_behind_a_borrowing_one() -> None:
    acme = _t("acme", guaranteed_blocks=10, max_blocks_per_engine=100)
    queue, _, _ = _queue(acme, stats=lambda: EngineStats(
        timestamp=0, total_blocks=100, free_blocks=12))
    queue.set_policy(make_policy(acme))
    big = queue.submit("acme", _shape(30))  # borrows: 12 free - 10 floor < 30
    small = queue.submit("acme", _shape(5))  # within its guarantee of 10
    assert not big.settled and big.waited_on is Decision.REJECTED_WATERMARK
    assert small.admitted


def test_a_lower_tier_uses_capacity_no_one_above_it_can_take() -> None:
    premium = _t("acme", tier="premium", priority=0, max_blocks_per_engine=10)
    free = _t("hobby", tier="free", priority=2, max_blocks_per_engine=100)
    queue, _, _ = _queue(premium, free)
    queue.submit("acme", _shape(10))
    over_quota = queue.submit("acme", _shape(5))  # premium waits on its own quota
    meanwhile = queue.submit("hobby", _shape(5))
    assert not over_quota.settled and meanwhile.admitted


def test_retry_after_is_when_the_tenants_own_requests_free_what_it_needs() -> None:
    """Issue 46: maxQueueSeconds 0 said 1 s while the request holding the quota ran for
    seconds, so the SDK's retries were spent before it ended. Now it is when the holder
    will have decoded its max_tokens at its rate so far (and never earlier), in
    milliseconds too."""
    acme = _t("acme", max_blocks_per_engine=100, max_concurrent_requests=1,
              max_queue_seconds=0)
    queue, clock, _ = _queue(acme)
    holder = queue.submit("acme", RequestShape((10,), 1000))
    assert holder.reservation is not None
    clock.now = 2.0
    holder.reservation.progress(250)  # 125 tokens a second: 750 more take 6 s
    refusals = [queue.submit("acme", _shape(1)) for _ in range(20)]
    waits = [int(t.error.headers["retry-after-ms"]) for t in refusals if t.error]
    assert len(waits) == 20 and all(6000 <= w <= 9000 for w in waits) and len(set(waits)) > 1
    assert {t.error.retry_after for t in refusals if t.error} <= set(range(6, 10))
    # Before it has decoded a token, and before any stream showed the engine's pace,
    # nothing is known: the tier's bound (1 s at least).
    fresh, _, _ = _queue(acme)
    fresh.submit("acme", RequestShape((10,), 1000))
    unknown = fresh.submit("acme", _shape(1))
    assert unknown.error is not None and unknown.error.retry_after == 1
    assert 1000 <= int(unknown.error.headers["retry-after-ms"]) <= 1500


def test_retry_after_for_a_holder_that_reports_no_progress_is_its_max_tokens_at_the_engines_pace(
) -> None:
    """A response that is not streamed never says how far it has decoded: it ends once
    its first token and the rest of its max_tokens per sequence have come at the pace
    the engine showed on the sidecar's streams, less the time it has run; Retry-After
    is never earlier than that (jittered up to half of it later)."""
    acme = _t("acme", max_blocks_per_engine=1000, max_concurrent_requests=1,
              max_queue_seconds=0)
    queue, clock, _ = _queue(acme)
    # Streams showed a first token after 0.5 s and 20 ms per further token.
    queue.pace.observe(first_token=0.5, duration=0.5 + 99 * 0.02, tokens=100)
    holder = queue.submit("acme", RequestShape((10,), 1000, n=2))  # 1000 per sequence
    assert holder.reservation is not None and holder.reservation.sequences == 2
    clock.now = 2.0  # ran 2 s: 0.5 + 999 * 0.02 - 2 = 18.48 s to go
    refusals = [queue.submit("acme", _shape(1)) for _ in range(20)]
    waits = [int(t.error.headers["retry-after-ms"]) for t in refusals if t.error]
    assert len(waits) == 20 and all(18480 <= w <= 27720 for w in waits)
    assert len(set(waits)) > 1  # jittered
    assert {t.error.retry_after for t in refusals if t.error} <= set(range(19, 29))


def test_retry_after_on_the_watermark_is_when_the_soonest_holders_free_enough_blocks(
) -> None:
    """A 503 on the engine's watermark: the requests in flight here, any tenant's, give
    their blocks back soonest first (a stream at its rate so far, a response not
    streamed at the engine's pace) until the blocks above the watermark cover what the
    refused request would borrow."""
    stats = [EngineStats(timestamp=0, total_blocks=1000, free_blocks=1000)]
    tenants = [_t(name, max_queue_seconds=0) for name in ("a", "b", "c", "d")]
    queue, clock, ledger = _queue(*tenants, stats=lambda: stats[-1])
    queue.pace.observe(first_token=0.5, duration=0.5 + 99 * 0.05, tokens=100)
    fast = queue.submit("a", RequestShape((639,), 100))
    slow = queue.submit("b", RequestShape((639,), 100))
    quiet = queue.submit("c", RequestShape((639,), 100))  # not streamed: no progress
    held = [t.reservation for t in (fast, slow, quiet)]
    assert all(r is not None for r in held)
    clock.now = 2.0
    fast.reservation.progress(50)  # 25 tokens a second: 50 more take 2 s
    slow.reservation.progress(20)  # 10 a second: 80 more take 8 s
    # quiet: 0.5 + 99 * 0.05 - 2 = 3.45 s
    free_first = fast.reservation.turn_blocks
    stats.append(EngineStats(timestamp=1, total_blocks=1000, free_blocks=300))
    # Above the floor (watermark 0.1 of 1000 blocks), less the holders' growth to come.
    above = queue.view().free_blocks - 100

    def refused_wait(prompt_blocks: int) -> list[int]:
        tickets = [queue.submit("d", _shape(prompt_blocks)) for _ in range(10)]
        assert all(t.error is not None and t.error.status == 503 for t in tickets)
        return [int(t.error.headers["retry-after-ms"]) for t in tickets if t.error]

    # Needs no more than the fast stream gives back: 2 s.
    assert all(2000 <= w <= 3000 for w in refused_wait(above + free_first))
    # Needs one block more: the response not streamed ends next, at 3.45 s.
    assert all(3450 <= w <= 5175 for w in refused_wait(above + free_first + 1))
    # More than all three give back: not known from them, the tier's bound (1 s).
    total = sum(r.turn_blocks for r in held if r is not None)
    assert all(1000 <= w <= 1500 for w in refused_wait(above + total + 1))
    assert ledger.total_inflight == 3


def test_retry_after_follows_the_drain_rate_and_is_jittered() -> None:
    acme = _t("acme", max_blocks_per_engine=10, max_concurrent_requests=1, max_queue_seconds=3)
    queue, clock, _ = _queue(acme)
    holder = queue.submit("acme", _shape(1))
    # Drain at 2 per second: release and re-admit eight times, half a second apart.
    for _ in range(8):
        clock.now += 0.5
        assert holder.reservation is not None
        holder.reservation.release()
        holder = queue.submit("acme", _shape(1))
        assert holder.admitted
    waiting = [queue.submit("acme", _shape(1)) for _ in range(5)]
    # At 2 per second, the fifth in line would wait 2.5 s: within the 3 s bound.
    assert not any(t.settled for t in waiting)
    too_many = [queue.submit("acme", _shape(1)) for _ in range(20)]
    # Beyond the sixth the predicted wait passes 3 s: refused at once, and the
    # Retry-After is the queue's drain time (about 3 s) jittered, not a constant.
    refused = [t for t in too_many if t.settled]
    assert len(refused) >= 18
    values = {t.error.retry_after for t in refused if t.error is not None}
    assert len(values) > 1 and all(1 <= v <= 6 for v in values if v is not None)


def test_a_tenant_the_new_policy_drops_is_refused_from_the_queue() -> None:
    acme = _t("acme", max_blocks_per_engine=10)
    queue, _, _ = _queue(acme, _t("other"))
    queue.submit("acme", _shape(10))
    waiting = queue.submit("acme", _shape(1))
    queue.set_policy(make_policy(_t("other")))
    assert queue.pump() == [waiting]
    assert waiting.error is not None and waiting.error.status == 403
