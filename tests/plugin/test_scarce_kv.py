"""Where KV is scarce: the sidecar's admission (the real queue) agrees with the plugin's
victim order on vLLM's real Scheduler, follow-up turns do not pay twice, prefill
compute and cache retention go to the higher tier, and leases follow session pauses."""

from __future__ import annotations

import pytest
from plugin_policies import Tokens, engine_policy, tenant, write_policy

from engine_sidecar.gateway.admission.rules import Decision
from engine_sidecar.plugin.rules.pauses import SessionPauses
from kvquota_lab.bench.admission import TwinGateway

BLOCK = 16


def _gateway(harness, policy) -> TwinGateway:
    """The sidecar's admission queue, reading the plugin's stats at every decision."""
    return TwinGateway(policy, clock=lambda: harness.now, stats=harness.kvq_stats,
                       stats_interval=0.0, max_model_len=None, seed=1)


def _run_until(harness, done, max_steps: int = 2_000) -> None:
    for _ in range(max_steps):
        if done():
            return
        harness.step()
    raise AssertionError("condition never met")


def test_premium_beyond_its_guarantee_is_admitted_by_reclaiming_a_free_borrower(
    make_harness, policy_path, tokens: Tokens
):
    policy = engine_policy(
        tenant("acme", "premium", guaranteed=10, max_blocks=200),
        tenant("hobby", "free", guaranteed=0, max_blocks=200),
        block_size=BLOCK, watermark=0.1,
    )
    write_policy(policy_path, policy)
    harness = make_harness(num_blocks=101, block_size=BLOCK, policy_path=policy_path,
                           max_num_batched_tokens=1024)
    gateway = _gateway(harness, policy)
    # Three free requests of 30 blocks each (28 of prompt): all that the 10-block
    # watermark floor leaves of the 100.
    free = []
    for i in range(3):
        prompt = tokens(448)
        ticket = gateway.submit("hobby", prompt, 32, None, None)
        assert ticket.admitted
        free.append(harness.add_request(f"free-{i}", prompt, 32, priority=2, tenant="hobby"))
    _run_until(harness, lambda: all(r.first_token_step is not None for r in free))
    # Premium asks for 32 blocks beyond its guarantee of 10. Nothing is left above the
    # floor, but the free tenant's borrowed blocks are what the victim order gives back
    # first, so it is admitted.
    prompt = tokens(480)
    ticket = gateway.submit("acme", prompt, 32, "chat", None)
    assert ticket.admitted and ticket.verdict is not None and ticket.verdict.borrowing
    premium = harness.add_request("premium", prompt, 32, priority=0, tenant="acme",
                                  session="chat")
    _run_until(harness, lambda: premium.first_token_step is not None)
    # The plugin made room at once: a free borrower was preempted for the waiting
    # premium request (vLLM alone never preempts for a waiting request).
    assert sum(r.num_preemptions for r in free) >= 1
    assert premium.first_token_step is not None
    assert premium.first_token_step < min(r.finish_step or 10**9 for r in free)
    stats = harness.kvq_stats().tenants
    assert stats["hobby"].preemptions.get("borrower", 0) >= 1
    # And now the free tenant is the one refused: nothing ranks below it.
    refused = gateway.submit("hobby", tokens(448), 32, None, None)
    assert not refused.admitted
    assert refused.verdict is not None
    assert refused.verdict.decision is Decision.REJECTED_WATERMARK


def test_stock_vllm_makes_the_waiting_premium_request_wait_for_the_burst(
    make_harness, tokens: Tokens
):
    """The control: vLLM's own priority scheduler admits a waiting request into free
    blocks only, so premium's first token comes after the free requests finish."""
    harness = make_harness(num_blocks=101, block_size=BLOCK, scheduler="stock-priority",
                           max_num_batched_tokens=1024)
    free = [harness.add_request(f"free-{i}", tokens(320), 300, priority=2) for i in range(4)]
    _run_until(harness, lambda: all(r.first_token_step is not None for r in free))
    premium = harness.add_request("premium", tokens(960), 32, priority=0)
    _run_until(harness, lambda: premium.first_token_step is not None)
    assert premium.first_token_step is not None
    assert premium.first_token_step > min(r.finish_step or 10**9 for r in free)


def test_a_follow_up_turn_is_admitted_with_its_leased_prefix_counted_once(
    make_harness, policy_path, tokens: Tokens
):
    policy = engine_policy(
        tenant("acme", "premium", guaranteed=0, max_blocks=40, lease_seconds=300),
        block_size=BLOCK,
    )
    write_policy(policy_path, policy)
    harness = make_harness(num_blocks=200, block_size=BLOCK, policy_path=policy_path)
    gateway = _gateway(harness, policy)
    first = tokens(480)  # 30 blocks
    ticket = gateway.submit("acme", first, 16, "chat", None)
    turn1 = harness.add_request("t1", first, 16, priority=0, tenant="acme", session="chat")
    harness.run_until_done()
    assert ticket.reservation is not None
    ticket.reservation.release()
    assert harness.kvq_stats().tenants["acme"].leases["chat"] == 30
    # Turn 2: 31 blocks of context + 2 more. Its lease already pins 30 of them: counted
    # once it needs 34 of its 40 (counted twice, 30 + 34, it would wait for ever).
    second = [*turn1.all_token_ids, *tokens(32)]
    follow_up = gateway.submit("acme", second, 16, "chat", None)
    assert follow_up.admitted and follow_up.verdict is not None
    assert follow_up.verdict.new_blocks < 5 < follow_up.verdict.blocks
    turn2 = harness.add_request("t2", second, 16, priority=0, tenant="acme", session="chat")
    harness.run_until_done()
    assert turn2.num_cached_tokens == 30 * BLOCK


def test_a_premium_request_gets_the_prefill_budget_before_free_chunks(
    make_harness, policy_path, tokens: Tokens
):
    write_policy(policy_path, engine_policy(
        tenant("acme", "premium", guaranteed=100), tenant("hobby", "free"), block_size=BLOCK,
    ))
    harness = make_harness(num_blocks=800, block_size=BLOCK, policy_path=policy_path,
                           max_num_batched_tokens=512)
    free = [harness.add_request(f"free-{i}", tokens(2_000), 8, priority=2, tenant="hobby")
            for i in range(3)]
    harness.step()  # the free prefills are under way (4 chunks each)
    premium = harness.add_request("premium", tokens(500), 8, priority=0, tenant="acme")
    _run_until(harness, lambda: premium.first_token_step is not None)
    # Premium's prompt went through in its own steps, ahead of the 12 free chunks.
    assert premium.first_token_step is not None
    assert premium.first_token_step <= 3
    assert all(r.first_token_step is None or r.first_token_step > premium.first_token_step
               for r in free)


def test_a_free_churn_evicts_its_own_cache_before_premiums(
    make_harness, policy_path, tokens: Tokens
):
    """Retention order: the premium session's cache is beyond its lease cap (1 block),
    so only vLLM's LRU keeps it; a free tenant churning through the cache recycles its
    own blocks first under the plugin, the premium ones under stock vLLM."""
    hits = {}
    for kind in ("kvquota", "stock-priority"):
        write_policy(policy_path, engine_policy(
            tenant("acme", "premium", guaranteed=100, lease_seconds=300, lease_blocks=1),
            tenant("hobby", "free"), block_size=BLOCK,
        ))
        harness = make_harness(num_blocks=120, block_size=BLOCK, scheduler=kind,
                               policy_path=policy_path if kind == "kvquota" else None)
        seq = Tokens(seed=5)
        context = seq(640)  # 40 blocks
        harness.add_request("t1", context, 16, priority=0, tenant="acme", session="s")
        harness.run_until_done()
        for i in range(8):  # one after another: each free request recycles 30 blocks
            harness.add_request(f"free-{i}", seq(480), 16, priority=2, tenant="hobby")
            harness.run_until_done()
            harness.advance(0.5)
        turn2 = harness.add_request("t2", [*harness.requests["t1"].all_token_ids, *seq(20)],
                                    16, priority=0, tenant="acme", session="s")
        harness.run_until_done()
        hits[kind] = turn2.num_cached_tokens
    assert hits["kvquota"] >= 39 * BLOCK
    assert hits["stock-priority"] < 10 * BLOCK


def test_a_lease_lasts_a_few_of_the_sessions_own_pauses(
    make_harness, policy_path, tokens: Tokens
):
    write_policy(policy_path, engine_policy(
        tenant("acme", "premium", guaranteed=100, lease_seconds=300), block_size=BLOCK,
    ))
    harness = make_harness(num_blocks=400, block_size=BLOCK, policy_path=policy_path)
    context = tokens(320)
    for turn in range(4):  # the session pauses 3 s between turns
        request = harness.add_request(f"t{turn}", context, 16, priority=0, tenant="acme",
                                      session="s")
        harness.run_until_done()
        context = [*request.all_token_ids, *tokens(16)]
        harness.advance(3.0)
    # The lease lasts c(n) of its 3 s pauses after the last turn, not the tier's 300 s:
    # three pauses in a mean weighted 0.49, 0.21, 0.3 are n = 1 / sum(w^2) = 2.67 pauses'
    # worth, c(2.67) = 9.27, 27.8 s. Alive a second before, gone a second after.
    hold = 3.0 * SessionPauses.pause_factor(1 / (0.49**2 + 0.21**2 + 0.3**2))
    harness.advance(hold - 3.0 - 1.0)
    leased = harness.kvq_stats().tenants["acme"].leases.get("s")
    assert leased is not None
    harness.advance(2.0)
    harness.add_request("other", tokens(32), 1, priority=0, tenant="acme")
    harness.run_until_done()
    stats = harness.kvq_stats().tenants["acme"]
    assert stats.leases.get("s") is None
    assert stats.lease_drops.get("expired") == 1
    # What it held for nothing: its blocks, from the last turn to its expiry `hold` later
    # (the earlier leases were renewed by the next turn: their session came back). Each
    # measured pause also holds the 10 ms step in which the turn finished: 1% of margin.
    assert stats.idle_lease_block_seconds == pytest.approx(leased * hold, rel=0.01)

    # A new session of the same tenant has shown no pause of its own: it keeps its
    # lease for the tier's whole 300 s, whatever the tenant's other sessions did.
    harness.add_request("new", tokens(320), 16, priority=0, tenant="acme", session="s2")
    harness.run_until_done()
    harness.advance(120.0)
    harness.add_request("tick", tokens(32), 1, priority=0, tenant="acme")
    harness.run_until_done()
    assert harness.kvq_stats().tenants["acme"].leases.get("s2") is not None


def test_sessions_of_a_tenant_that_never_come_back_hold_briefly(
    make_harness, policy_path, tokens: Tokens
):
    write_policy(policy_path, engine_policy(
        tenant("api", "standard", guaranteed=100, lease_seconds=60), block_size=BLOCK,
    ))
    harness = make_harness(num_blocks=400, block_size=BLOCK, policy_path=policy_path)

    def one_shot(session: str) -> None:
        harness.add_request(session, tokens(160), 16, priority=1, tenant="api",
                            session=session)
        harness.run_until_done()

    def leased(session: str) -> bool:
        harness.add_request("tick", tokens(32), 1, priority=1, tenant="api")
        harness.run_until_done()  # a step: expired leases go at its start
        return session in harness.kvq_stats().tenants["api"].leases

    # One-shot calls that carry a session id: each lease holds the tier's 60 s for a
    # session that never returns, 20 times over (SessionPauses.RETURN_WINDOW).
    for n in range(20):
        one_shot(f"call-{n}")
        harness.advance(61.0)
        assert not leased(f"call-{n}")
    wasted = harness.kvq_stats().tenants["api"].idle_lease_block_seconds
    # The 21st holds only MIN_HOLD_S (10 s): alive 9 s on, gone 11 s on.
    one_shot("call-20")
    harness.advance(9.0)
    assert leased("call-20")
    harness.advance(2.0)
    assert not leased("call-20")
    held = harness.kvq_stats().tenants["api"].idle_lease_block_seconds - wasted
    assert held < wasted / 20 / 5  # one 10 s lease against the mean 60 s one (+ margin)
    # One session that does come back restores the full lease for new sessions.
    one_shot("chat")
    harness.advance(5.0)
    one_shot("chat")
    one_shot("call-21")
    harness.advance(30.0)
    assert leased("call-21")
