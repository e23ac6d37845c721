"""A tenant at its maxBlocks runs more work into KV nobody else wants (aboveMax:
Reclaimable), gives it back to anyone who asks, and keeps a hard ceiling with Never."""

from __future__ import annotations

import random
import time

from engine_sidecar.contract.reclaim import Band
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import Decision, RequestShape

from .helpers import FULL_RESERVATION, make_policy, tenant

BLOCK = 32
TOTAL = 1_000  # blocks; the watermark (0.1) keeps 100 of them
PROMPT = 32 * 9  # 9 blocks, + max_tokens 32: 10 blocks a request


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _queue(capped: str = "Reclaimable", *, held: dict[str, int] | None = None,
           clock: Clock | None = None) -> AdmissionQueue:
    """`acme` (premium) may hold 30 blocks; `cheap` (free) is guaranteed 100. `held`:
    the blocks each tenant's running requests hold, as the plugin reports them (read
    at every decision: a test may change it)."""
    acme = tenant("acme", tier="premium", priority=0, max_tokens=32, max_blocks_per_engine=30,
                  above_max=capped, prefix_cache_isolation="Shared", max_queue_seconds=30)
    cheap = tenant("cheap", tier="free", priority=2, max_tokens=32, guaranteed_blocks=100,
                   max_blocks_per_engine=2_000, prefix_cache_isolation="Shared",
                   max_queue_seconds=30)
    holding = held if held is not None else {}

    def stats() -> EngineStats:
        return EngineStats(
            timestamp=time.time(), total_blocks=TOTAL, free_blocks=TOTAL - sum(holding.values()),
            tenants={t: TenantEngineStats(running_blocks=n, running=1)
                     for t, n in holding.items()})

    queue = AdmissionQueue(Ledger(), clock=clock or Clock(), rng=random.Random(1),
                           stats=stats, max_model_len=lambda: None)
    queue.set_policy(make_policy(acme, cheap, reservation=FULL_RESERVATION, auth={}))
    return queue


def _ask(queue: AdmissionQueue, tenant_id: str = "acme", prompt: int = PROMPT) -> Ticket:
    return queue.submit(tenant_id, RequestShape((prompt,), 32))


def test_a_capped_tenant_runs_into_idle_kv_beyond_its_max_blocks() -> None:
    queue = _queue()
    within = [_ask(queue) for _ in range(3)]  # 30 blocks: its maxBlocks
    assert all(t.admitted and t.verdict and not t.verdict.above_max for t in within)
    beyond = _ask(queue)
    assert beyond.admitted, "idle KV nobody waits for was left idle"
    assert beyond.verdict is not None and beyond.verdict.above_max
    assert queue.view().tenant("acme").charged == 40


def test_never_keeps_max_blocks_a_hard_ceiling_and_counts_the_wait_beside_idle_kv() -> None:
    clock = Clock()
    queue = _queue("Never", clock=clock)
    for _ in range(3):
        assert _ask(queue).admitted
    waiting = _ask(queue)
    assert not waiting.settled and waiting.verdict is not None
    assert waiting.verdict.decision is Decision.REJECTED_QUOTA
    clock.now = 2.0
    queue.pump()
    assert not waiting.settled
    # The 10 blocks it asked for were free above the watermark the whole time.
    assert queue.idle_waits == {"acme": 2.0}


def test_nobody_goes_beyond_max_blocks_while_another_tenant_waits_for_capacity() -> None:
    # `cheap` borrows beyond its guarantee and the engine is at the watermark: it waits
    # for capacity, so the free blocks are wanted and acme stays at its maxBlocks.
    queue = _queue(held={"cheap": 880})
    for _ in range(2):
        assert _ask(queue).admitted
    starved = _ask(queue, "cheap", prompt=32 * 19)
    assert not starved.settled and starved.verdict is not None
    assert starved.verdict.decision is Decision.REJECTED_WATERMARK
    third, fourth = _ask(queue), _ask(queue)
    assert third.admitted
    assert not fourth.settled and fourth.verdict is not None
    assert fourth.verdict.decision is Decision.REJECTED_QUOTA


def test_work_beyond_max_blocks_is_what_any_other_request_reclaims_first() -> None:
    held = {"cheap": 850}
    queue = _queue(held=held)
    tickets = [_ask(queue) for _ in range(5)]  # 3 within its 30 blocks, 2 beyond
    assert [t.verdict.above_max for t in tickets if t.verdict] == [False] * 3 + [True] * 2
    held["acme"] = 50  # all five run
    # A free request that borrows may count on the 18 blocks the premium tenant's work
    # beyond its maxBlocks holds (two prompts of 9: the victim order gives them back
    # first), never on the work within it, though the engine's free blocks are all kept
    # by the watermark.
    view = queue.view()
    assert view.holding("acme").above_max == 18
    assert view.reclaimable("cheap", Band.BORROWER, 0) == 18
    # 17 + 1 blocks, then 18 + 1.
    fits, too_big = _ask(queue, "cheap", prompt=32 * 17), _ask(queue, "cheap", prompt=32 * 18)
    assert fits.admitted and fits.verdict is not None and fits.verdict.borrowing
    assert not too_big.settled and too_big.verdict is not None
    assert too_big.verdict.decision is Decision.REJECTED_WATERMARK


def test_blocks_a_tenant_holds_beyond_max_blocks_by_other_means_stay_its_own() -> None:
    # 200 blocks against its 30 (leases, growth past its estimates), none of it admitted
    # beyond the ceiling: a higher tier's to keep, whatever aboveMax says.
    for capped in ("Reclaimable", "Never"):
        queue = _queue(capped, held={"acme": 200, "cheap": 700})
        assert queue.view().reclaimable("cheap", Band.BORROWER, 0) == 0
        big = _ask(queue, "cheap", prompt=32 * 149)
        assert not big.settled and big.verdict is not None
        assert big.verdict.decision is Decision.REJECTED_WATERMARK


def test_a_request_that_may_not_wait_still_runs_into_idle_kv() -> None:
    # maxQueueSeconds 0: settled the moment it arrives, at its deadline.
    queue = _queue()
    assert queue.policy is not None
    acme = queue.policy.tenants["acme"].model_copy(update={"max_queue_seconds": 0})
    queue.set_policy(queue.policy.model_copy(
        update={"tenants": {**queue.policy.tenants, "acme": acme}}))
    for _ in range(3):
        assert _ask(queue).admitted
    beyond = _ask(queue)
    assert beyond.admitted and beyond.verdict is not None and beyond.verdict.above_max
