"""TenantAwareScheduler inside vLLM's real V1 scheduler (CPU, no model, fake outputs).

Each test drives `kvquota_lab.twin.harness.SchedulerHarness` on virtual time and asserts
what a tenant would notice: prefix-cache hits, who got preempted, whether requests
complete, what the stats file says.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from plugin_policies import Tokens, engine_policy, tenant, write_policy

BLOCK = 16


def _first_preemption_order(harness) -> list[str]:
    order: list[str] = []
    for step in harness.steps:
        for req_id in step.preempted_req_ids:
            if req_id not in order:
                order.append(req_id)
    return order


def _assert_blocks_add_up(harness) -> None:
    """Every block not free is held by running work or pinned by a lease, counted once."""
    stats = harness.kvq_stats()
    used = sum(t.running_blocks + t.leased_blocks for t in stats.tenants.values())
    assert used == stats.total_blocks - stats.free_blocks


def _assert_priorities_untouched(harness) -> None:
    """The priority a request was sent with is the one it has between steps (the
    victim mark lives only inside schedule(), and never in the waiting heap)."""
    for req_id, request in harness.scheduler.requests.items():
        assert request.priority == harness.requests[req_id].priority, req_id


def _saturate_with_free_burst(harness, tokens: Tokens, *, count: int, prompt: int) -> None:
    for i in range(count):
        harness.add_request(f"burst-{i}", tokens(prompt), 64, priority=2, tenant="freeco")
    for _ in range(5_000):
        if not harness.has_unfinished():
            return
        harness.step()
        if harness.plugin is not None and len(harness.steps) % 7 == 0:
            _assert_blocks_add_up(harness)
    raise AssertionError("the burst did not finish")


# -- a. an idle premium session keeps its prefix through a free-tier burst ----------------


def _idle_premium_session_through_burst(make_harness, policy_path, kind: str):
    tokens = Tokens(seed=1)
    write_policy(policy_path, engine_policy(
        tenant("acme", "premium", guaranteed=200, lease_seconds=300),
        tenant("freeco", "free", guaranteed=0),
    ))
    harness = make_harness(num_blocks=640, block_size=BLOCK, scheduler=kind,
                           policy_path=policy_path if kind == "kvquota" else None)
    turn1 = harness.add_request("turn1", tokens(1600), 32, priority=0,
                                tenant="acme", session="s1")
    harness.run_until_done()
    harness.advance(20)  # the user reads the answer
    # 24 x 900-token prompts (~1,440 blocks of demand) into 639 blocks.
    _saturate_with_free_burst(harness, tokens, count=24, prompt=900)
    harness.advance(20)
    context = turn1.all_token_ids
    turn2 = harness.add_request("turn2", [*context, *tokens(60)], 16, priority=0,
                                tenant="acme", session="s1")
    harness.run_until_done()
    return harness, turn2, len(context)


def test_idle_premium_session_keeps_its_prefix_through_a_free_burst(make_harness, policy_path):
    harness, turn2, context_len = _idle_premium_session_through_burst(
        make_harness, policy_path, "kvquota"
    )

    assert turn2.num_cached_tokens >= 0.9 * context_len
    burst = [r for r in harness.requests.values() if r.req_id.startswith("burst-")]
    assert all(r.finished for r in burst)
    assert sum(r.num_preemptions for r in burst) > 0, "the burst must really saturate the cache"
    stats = harness.kvq_stats()
    assert stats.tenants["acme"].leased_sessions == 1
    assert stats.tenants["acme"].lease_breaks == 0
    assert stats.tenants["acme"].prefix_hit_tokens == turn2.num_cached_tokens


def test_stock_priority_scheduler_loses_the_idle_session_prefix(make_harness, policy_path):
    _, turn2, context_len = _idle_premium_session_through_burst(
        make_harness, policy_path, "stock-priority"
    )

    assert turn2.num_cached_tokens < 0.5 * context_len


# -- b. leases expire ---------------------------------------------------------------------


def test_expired_lease_returns_its_blocks_to_the_lru(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(tenant("acme", guaranteed=100, lease_seconds=60)))
    harness = make_harness(num_blocks=201, block_size=BLOCK, policy_path=policy_path)
    total = harness.kvq_stats().total_blocks
    turn1 = harness.add_request("t1", tokens(320), 8, tenant="acme", session="s1")
    harness.run_until_done()
    leased = harness.kvq_stats()
    assert leased.tenants["acme"].leased_sessions == 1
    assert leased.tenants["acme"].leased_blocks == 20  # 327 computed tokens: 20 full blocks
    assert leased.free_blocks == total - 20
    idle_snapshot = harness.plugin.kvq_snapshot()

    harness.advance(59)
    harness.step()
    assert harness.kvq_stats().tenants["acme"].leased_sessions == 1

    harness.advance(2)
    harness.step()
    expired = harness.kvq_stats()
    assert expired.tenants["acme"].leased_sessions == 0
    assert expired.tenants["acme"].leased_blocks == 0
    assert expired.free_blocks == total
    assert expired.tenants["acme"].lease_drops == {"expired": 1}
    assert expired.tenants["acme"].lease_breaks == 0
    # What the stats thread writes while the engine idles past the expiry.
    rendered = idle_snapshot.render(harness.now, 0.0)
    assert rendered.tenants["acme"].leased_blocks == 0
    assert rendered.free_blocks == total

    # Back in vLLM's LRU, not wiped: without pressure the next turn still hits.
    turn2 = harness.add_request("t2", [*turn1.all_token_ids, *tokens(30)], 4,
                                tenant="acme", session="s1")
    harness.run_until_done()
    assert turn2.num_cached_tokens == 320


def test_session_activity_extends_the_lease(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(tenant("acme", guaranteed=100, lease_seconds=60)))
    harness = make_harness(num_blocks=201, block_size=BLOCK, policy_path=policy_path)
    turn1 = harness.add_request("t1", tokens(320), 8, tenant="acme", session="s1")
    harness.run_until_done()
    harness.advance(50)
    turn2 = harness.add_request("t2", [*turn1.all_token_ids, *tokens(40)], 8,
                                tenant="acme", session="s1")
    harness.run_until_done()
    harness.advance(50)  # 100 s after turn 1, 50 s after turn 2
    harness.step()

    stats = harness.kvq_stats().tenants["acme"]
    assert stats.leased_sessions == 1
    assert stats.leased_blocks == len(turn2.all_token_ids) // BLOCK
    assert stats.lease_drops == {}


def test_a_running_turn_and_its_lease_count_shared_blocks_once(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(tenant("acme", guaranteed=100, lease_seconds=60)))
    harness = make_harness(num_blocks=201, block_size=BLOCK, policy_path=policy_path)
    turn1 = harness.add_request("t1", tokens(320), 8, tenant="acme", session="s1")
    harness.run_until_done()
    harness.add_request("t2", [*turn1.all_token_ids, *tokens(64)], 200, tenant="acme",
                        session="s1")
    for _ in range(10):
        harness.step()

    stats = harness.kvq_stats().tenants["acme"]
    assert stats.running == 1 and stats.leased_sessions == 1
    assert stats.leased_blocks == 0  # all 20 pinned blocks are turn 2's prefix
    assert stats.running_blocks == (327 + 64 + 10) // BLOCK + 1
    _assert_blocks_add_up(harness)


def test_lease_caps_keep_the_newest_sessions(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(
        tenant("acme", guaranteed=500, lease_seconds=300, lease_sessions=2, lease_blocks=25)
    ))
    harness = make_harness(num_blocks=501, block_size=BLOCK, policy_path=policy_path)
    turns = []
    for i in range(3):
        turns.append(harness.add_request(f"t{i}", tokens(320), 8, tenant="acme",
                                         session=f"s{i}"))
        harness.run_until_done()
        harness.advance(1)

    stats = harness.kvq_stats().tenants["acme"]
    # 3 sessions x 20 blocks under maxSessions=2, maxBlocks=25: only the newest fits.
    assert stats.leased_sessions == 1
    assert stats.leased_blocks == 20
    assert stats.lease_drops == {"cap": 2}


# -- c. victim order ----------------------------------------------------------------------


def test_victim_order_unclassified_then_borrower_then_lower_tier(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=100),
        tenant("silver", "standard", guaranteed=100),
        tenant("bronze", "free", guaranteed=0),  # any usage is borrowed
    ))
    # 4 x 10-block prompts fill 40 blocks; decoding then forces preemptions.
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path)
    # The unclassified request carries vLLM priority 0 and arrives first: the stock
    # priority policy would preempt it last.
    harness.add_request("anon", tokens(160), 300, priority=0)
    harness.add_request("gold", tokens(160), 300, priority=0, tenant="gold")
    harness.add_request("silver", tokens(160), 300, priority=1, tenant="silver")
    harness.add_request("bronze", tokens(160), 300, priority=2, tenant="bronze")
    while harness.has_unfinished():
        harness.step()
        _assert_priorities_untouched(harness)

    order = _first_preemption_order(harness)
    assert order[:3] == ["anon", "bronze", "silver"]
    assert harness.requests["gold"].num_preemptions == 0
    stats = harness.kvq_stats().tenants
    assert stats["_unclassified"].preemptions["unclassified"] >= 1
    assert stats["bronze"].preemptions["borrower"] >= 1
    assert stats["silver"].preemptions["tier"] >= 1


@pytest.mark.parametrize(("kind", "first_victim"), [
    ("kvquota", "gold"),  # borrowing premium gives way before free within its guarantee
    ("stock-priority", "bronze"),
])
def test_borrowers_yield_before_tenants_within_their_guarantee(
    make_harness, policy_path, tokens, kind, first_victim
):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=0),
        tenant("bronze", "free", guaranteed=100),
    ))
    harness = make_harness(num_blocks=21, block_size=BLOCK, scheduler=kind,
                           policy_path=policy_path if kind == "kvquota" else None)
    harness.add_request("gold", tokens(160), 60, priority=0, tenant="gold")
    harness.add_request("bronze", tokens(160), 60, priority=2, tenant="bronze")
    harness.run_until_done()

    assert _first_preemption_order(harness)[0] == first_victim


@pytest.mark.parametrize(("kind", "first_victim"), [
    ("kvquota", "short"),  # the least computed work is lost
    ("stock-priority", "long"),  # vLLM: same priority, newest arrival
])
def test_within_a_class_the_victim_loses_the_least_work(
    make_harness, policy_path, tokens, kind, first_victim
):
    write_policy(policy_path, engine_policy(tenant("gold", guaranteed=100)))
    # 12 + 22 blocks at the end into 30: one of them must give way.
    harness = make_harness(num_blocks=31, block_size=BLOCK, scheduler=kind,
                           policy_path=policy_path if kind == "kvquota" else None)
    harness.add_request("short", tokens(80), 100, priority=0, tenant="gold")
    harness.advance(1)
    harness.add_request("long", tokens(240), 100, priority=0, tenant="gold")
    harness.run_until_done()

    assert _first_preemption_order(harness)[0] == first_victim


def test_lower_tier_leases_break_first(make_harness, policy_path, tokens):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=100, lease_seconds=300),
        tenant("silver", "standard", guaranteed=100, lease_seconds=300),
    ))
    harness = make_harness(num_blocks=61, block_size=BLOCK, policy_path=policy_path)
    silver = harness.add_request("silver", tokens(320), 8, priority=1, tenant="silver",
                                 session="s")
    harness.run_until_done()
    harness.advance(1)
    gold = harness.add_request("gold", tokens(320), 8, priority=0, tenant="gold", session="g")
    harness.run_until_done()
    harness.advance(1)
    # 40 of 60 blocks are pinned; a new gold session needs 30.
    harness.add_request("gold-new", tokens(480), 8, priority=0, tenant="gold", session="g2")
    harness.run_until_done()

    stats = harness.kvq_stats().tenants
    assert stats["silver"].lease_breaks == 1
    assert stats["silver"].preemptions == {"lease_break": 1}
    assert stats["gold"].lease_breaks == 0
    assert stats["gold"].leased_sessions == 2
    harness.add_request("gold-2", [*gold.all_token_ids, *tokens(16)], 4, tenant="gold",
                        session="g")
    harness.add_request("silver-2", [*silver.all_token_ids, *tokens(16)], 4, priority=1,
                        tenant="silver", session="s")
    harness.run_until_done()
    assert harness.requests["gold-2"].num_cached_tokens == 320
    # The broken lease went back to the LRU tail first: its head may survive, not all.
    assert harness.requests["silver-2"].num_cached_tokens < 320


def test_no_policy_picks_the_same_victims_as_stock_priority(make_harness, tokens):
    runs = {}
    for kind in ("kvquota", "stock-priority"):
        prompts = Tokens(seed=3)
        harness = make_harness(num_blocks=61, block_size=BLOCK, scheduler=kind)
        for i in range(8):
            harness.add_request(f"r{i}", prompts(96 + 16 * i), 80, priority=i % 3,
                                tenant="acme", session=f"s{i}")
            harness.advance(0.1)
        harness.run_until_done()
        runs[kind] = [(s.preempted_req_ids, sorted(s.num_scheduled_tokens)) for s in harness.steps]
    assert any(preempted for preempted, _ in runs["kvquota"])
    assert runs["kvquota"] == runs["stock-priority"]


# -- d. degraded mode ---------------------------------------------------------------------


def test_all_premium_leased_saturation_completes_every_request(
    make_harness, policy_path, tokens, caplog
):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=1000, lease_seconds=300),
        tenant("freeco", "free", guaranteed=0),
    ))
    harness = make_harness(num_blocks=101, block_size=BLOCK, policy_path=policy_path)
    sessions = []
    for i in range(9):  # 9 idle sessions x 10 blocks pin 90 of 100 blocks
        sessions.append(harness.add_request(f"g{i}", tokens(160), 8, tenant="gold",
                                            session=f"s{i}"))
        harness.run_until_done()
        harness.advance(1)
    assert harness.kvq_stats().tenants["gold"].leased_blocks == 90

    caplog.set_level(logging.WARNING, logger="engine_sidecar")
    for i in range(4):  # each needs 30 blocks: only breaking premium leases makes room
        harness.add_request(f"free-{i}", tokens(480), 16, priority=2, tenant="freeco")
    degraded_seen = False
    for _ in range(2_000):
        if not harness.has_unfinished():
            break
        harness.step()
        degraded_seen |= harness.kvq_stats().degraded
    assert all(r.finished for r in harness.requests.values())

    stats = harness.kvq_stats()
    gold = stats.tenants["gold"]
    assert degraded_seen and not stats.degraded
    assert gold.degraded_events == gold.lease_breaks == gold.preemptions["degraded"] >= 2
    assert stats.degraded_episodes == 1
    assert len([r for r in caplog.records if "degraded" in r.getMessage()]) == 1
    # The oldest leases went first: the newest session still hits.
    newest, oldest = sessions[-1], sessions[0]
    harness.add_request("new-2", [*newest.all_token_ids, *tokens(8)], 4, tenant="gold",
                        session="s8")
    harness.add_request("old-2", [*oldest.all_token_ids, *tokens(8)], 4, tenant="gold",
                        session="s0")
    harness.run_until_done()
    assert harness.requests["new-2"].num_cached_tokens == 160
    assert harness.requests["old-2"].num_cached_tokens == 0


# -- e/f. policy hot-load -----------------------------------------------------------------


def test_policy_hot_reload_mid_run_keeps_running_requests(make_harness, policy_path, tokens):
    v1 = engine_policy(tenant("acme", guaranteed=200))  # no lease
    write_policy(policy_path, v1)
    harness = make_harness(num_blocks=401, block_size=BLOCK, policy_path=policy_path)
    long_runs = [harness.add_request(f"long-{i}", tokens(200), 150, tenant="acme",
                                     session=f"l{i}") for i in range(4)]
    for _ in range(20):
        harness.step()
    assert harness.kvq_stats().policy_version == v1.version

    v2 = engine_policy(tenant("acme", guaranteed=200, lease_seconds=300))
    write_policy(policy_path, v2)
    harness.advance(1)  # the plugin looks at the file at most every 0.5 s
    harness.step()
    assert harness.kvq_stats().policy_version == v2.version
    chat = harness.add_request("chat", tokens(160), 8, tenant="acme", session="c")
    harness.run_until_done()

    assert all(len(r.output_token_ids) == 150 and r.num_preemptions == 0 for r in long_runs)
    stats = harness.kvq_stats().tenants["acme"]
    # Leased after v2: the long runs' sessions and the chat.
    assert stats.leased_sessions == 5
    assert chat.finished

    v3 = engine_policy(tenant("acme", guaranteed=200))  # leases withdrawn
    write_policy(policy_path, v3)
    harness.advance(1)
    harness.step()
    stats = harness.kvq_stats().tenants["acme"]
    assert stats.leased_sessions == 0
    assert stats.lease_drops == {"policy": 5}


def test_malformed_policy_keeps_the_last_good_one(make_harness, policy_path, tokens, caplog):
    good = engine_policy(tenant("acme", guaranteed=200, lease_seconds=300))
    write_policy(policy_path, good)
    harness = make_harness(num_blocks=401, block_size=BLOCK, policy_path=policy_path)
    caplog.set_level(logging.ERROR, logger="engine_sidecar")

    policy_path.write_text("{ this is not json")
    for _ in range(4):  # several polls of the same bad file
        harness.advance(1)
        harness.step()
    stats = harness.kvq_stats()
    assert stats.policy_version == good.version
    assert stats.policy_error is not None and "invalid policy" in stats.policy_error
    errors = [r for r in caplog.records if "invalid policy" in r.getMessage()]
    assert len(errors) == 1
    # The last good policy still applies: the session is leased.
    harness.add_request("t1", tokens(160), 8, tenant="acme", session="s")
    harness.run_until_done()
    assert harness.kvq_stats().tenants["acme"].leased_sessions == 1

    bad = json.loads(good.to_json())
    bad["tenants"]["acme"]["maxBlocks"] = 1  # below guaranteedBlocks
    bad.pop("version")
    policy_path.write_text(json.dumps(bad))
    harness.advance(1)
    harness.step()
    stats = harness.kvq_stats()
    assert stats.policy_version == good.version
    assert "maxBlocks" in (stats.policy_error or "")

    fixed = engine_policy(tenant("acme", guaranteed=300, lease_seconds=300))
    write_policy(policy_path, fixed)
    harness.advance(1)
    harness.step()
    stats = harness.kvq_stats()
    assert stats.policy_version == fixed.version
    assert stats.policy_error is None
    assert stats.tenants["acme"].leased_sessions == 1


# -- preemption mode: offload vs recompute (vLLM's OffloadingConnector) -------------------

OFFLOAD_BYTES = 64 << 20


def _preempt_bronze_then_flush_its_cache(harness, tokens: Tokens) -> list[int]:
    """A premium decode preempts a free 20-block prompt; a standard request then takes
    the freed blocks, so the victim's own KV survives only in the offload tier. Returns
    the victim's swappedBlocks after every step (plugin only)."""
    harness.add_request("gold", tokens(240), 120, priority=0, tenant="gold")
    harness.add_request("bronze", tokens(320), 40, priority=2, tenant="bronze")
    swapped: list[int] = []
    while harness.has_unfinished():
        step = harness.step()
        if step.preempted_req_ids and "filler" not in harness.requests:
            harness.add_request("filler", tokens(288), 8, priority=1, tenant="silver")
        if harness.plugin is not None:
            swapped.append(harness.kvq_stats().tenants["bronze"].swapped_blocks)
    assert _first_preemption_order(harness) == ["bronze"]
    return swapped


def _prefill_tokens_after_preemption(harness, req_id: str) -> int:
    preempted, total = False, 0
    for step in harness.steps:
        if req_id in step.preempted_req_ids:
            preempted = True
        elif preempted and (n := step.num_scheduled_tokens.get(req_id, 0)) > 1:
            total += n
    return total


def _offload_policy(policy_path: Path, recompute_below_blocks: int) -> None:
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=100),
        tenant("silver", "standard", guaranteed=100),
        tenant("bronze", "free", guaranteed=0),
        recompute_below_blocks=recompute_below_blocks,
    ))


def test_a_large_victim_reloads_its_kv_from_the_offload_tier(make_harness, policy_path, tokens):
    _offload_policy(policy_path, recompute_below_blocks=8)  # the victim holds 22 blocks
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path,
                           kv_offload_bytes=OFFLOAD_BYTES)
    swapped = _preempt_bronze_then_flush_its_cache(harness, tokens)

    bronze = harness.requests["bronze"]
    assert bronze.finish_reason == "length"
    assert bronze.num_loaded_blocks == 20  # its whole prompt came back
    # Only the tokens it had generated are computed again (vLLM offloads prompts).
    assert _prefill_tokens_after_preemption(harness, "bronze") < 2 * BLOCK + 8
    stats = harness.kvq_stats()
    assert stats.preemption_mode == "offload"
    assert stats.preemptions_by_mode == {"offload": 1}
    assert max(swapped) == 22 and swapped[-1] == 0  # shown while it waited


@pytest.mark.parametrize(("kind", "reloaded"), [("kvquota", False), ("stock-priority", True)])
def test_a_victim_below_recompute_below_blocks_recomputes(
    make_harness, policy_path, tokens, kind, reloaded
):
    _offload_policy(policy_path, recompute_below_blocks=64)
    harness = make_harness(num_blocks=41, block_size=BLOCK, scheduler=kind,
                           policy_path=policy_path if kind == "kvquota" else None,
                           kv_offload_bytes=OFFLOAD_BYTES)
    swapped = _preempt_bronze_then_flush_its_cache(harness, tokens)

    bronze = harness.requests["bronze"]
    assert bronze.finish_reason == "length"
    assert (bronze.num_loaded_blocks > 0) is reloaded  # stock vLLM reloads every victim
    if kind == "kvquota":
        assert _prefill_tokens_after_preemption(harness, "bronze") >= 320
        assert harness.kvq_stats().preemptions_by_mode == {"recompute": 1}
        assert not any(swapped)


def test_a_victim_aborted_before_resuming_leaves_no_swapped_blocks(
    make_harness, policy_path, tokens
):
    _offload_policy(policy_path, recompute_below_blocks=8)
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path,
                           kv_offload_bytes=OFFLOAD_BYTES)
    harness.add_request("gold", tokens(240), 120, priority=0, tenant="gold")
    harness.add_request("bronze", tokens(320), 40, priority=2, tenant="bronze")
    while not harness.requests["bronze"].num_preemptions:
        harness.step()
    assert harness.kvq_stats().tenants["bronze"].swapped_blocks == 22
    harness.abort(["bronze"])
    harness.run_until_done()

    stats = harness.kvq_stats()
    assert stats.tenants["bronze"].swapped_blocks == 0
    assert stats.preemptions_by_mode == {}  # it never came back


def test_without_offloading_every_preemption_recomputes(make_harness, policy_path, tokens):
    _offload_policy(policy_path, recompute_below_blocks=8)
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path)
    _preempt_bronze_then_flush_its_cache(harness, tokens)

    assert harness.requests["bronze"].num_loaded_blocks == 0
    stats = harness.kvq_stats()
    assert stats.preemption_mode == "recompute"
    assert stats.preemptions_by_mode == {"recompute": 1}
    assert _prefill_tokens_after_preemption(harness, "bronze") >= 320


# -- stats channel --------------------------------------------------------------------------


def test_stats_file_reports_every_tenant(make_harness, policy_path, tokens, tmp_path: Path):
    from engine_sidecar.contract.stats import EngineStats

    stats_path = tmp_path / "stats.json"
    policy = engine_policy(tenant("acme", guaranteed=100, lease_seconds=300),
                           tenant("idle", "free"))
    write_policy(policy_path, policy)
    harness = make_harness(num_blocks=201, block_size=BLOCK, policy_path=policy_path,
                           stats_path=stats_path)
    harness.add_request("t1", tokens(320), 8, tenant="acme", session="s1")
    harness.add_request("anon", tokens(64), 8)
    harness.run_until_done()
    harness.shutdown()  # writes the final state

    stats = EngineStats.model_validate_json(stats_path.read_text())
    assert stats.policy_version == policy.version
    assert set(stats.tenants) == {"acme", "idle", "_unclassified"}
    assert stats.tenants["acme"].leased_blocks == 20
    assert stats.tenants["acme"].prompt_tokens == 320
    assert stats.tenants["_unclassified"].prompt_tokens == 64
    assert stats.total_blocks == 200
    assert stats.free_blocks == 180
    assert stats.preemption_mode == "recompute"


def test_async_scheduling_uses_the_async_variant(make_harness, policy_path, tokens):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    write_policy(policy_path, engine_policy(tenant("acme", guaranteed=100, lease_seconds=300)))
    harness = make_harness(num_blocks=201, block_size=BLOCK, policy_path=policy_path,
                           async_scheduling=True)
    assert isinstance(harness.scheduler, AsyncScheduler)
    turn1 = harness.add_request("t1", tokens(320), 8, tenant="acme", session="s1")
    harness.run_until_done()
    turn2 = harness.add_request("t2", [*turn1.all_token_ids, *tokens(16)], 4, tenant="acme",
                                session="s1")
    harness.run_until_done()
    assert turn2.num_cached_tokens == 320


def _victim_order_workload(harness, tokens: Tokens) -> None:
    """Four 10-block prompts in 40 blocks: decoding forces preemptions, which the plugin
    turns into its victim order only if it hears of every failed allocation."""
    harness.add_request("anon", tokens(160), 300, priority=0)
    harness.add_request("gold", tokens(160), 300, priority=0, tenant="gold")
    harness.add_request("silver", tokens(160), 300, priority=1, tenant="silver")
    harness.add_request("bronze", tokens(160), 300, priority=2, tenant="bronze")


def _three_tiers(policy_path: Path) -> None:
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=100),
        tenant("silver", "standard", guaranteed=100),
        tenant("bronze", "free", guaranteed=0),
    ))


def test_the_kv_hook_is_installed_once_when_the_scheduler_is_built(
    make_harness, policy_path, tokens
):
    """vLLM's allocate_slots is never reassigned on the KV cache manager while the
    engine steps, and the one hook installed at construction applies the victim order."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    _three_tiers(policy_path)
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path)
    manager = harness.scheduler.kv_cache_manager
    built = (type(manager), type(manager).allocate_slots, dict(vars(manager)).get("allocate_slots"))
    assert isinstance(manager, KVCacheManager)
    assert built[2] is None  # no per-instance function shadows the manager's method
    _victim_order_workload(harness, tokens)
    while harness.has_unfinished():
        harness.step()
        now = (type(manager), type(manager).allocate_slots, vars(manager).get("allocate_slots"))
        assert now == built
        assert harness.scheduler.kv_cache_manager is manager
    assert _first_preemption_order(harness)[:3] == ["anon", "bronze", "silver"]
    assert harness.requests["gold"].num_preemptions == 0


def test_other_wrappers_of_allocate_slots_survive_the_hook(make_harness, policy_path, tokens):
    """A profiler or fault injector that wraps the KV cache manager's allocate_slots
    keeps seeing every call, and the plugin keeps its victim order underneath it."""
    _three_tiers(policy_path)
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path)
    manager = harness.scheduler.kv_cache_manager
    inner = manager.allocate_slots
    calls = {"profiler": 0, "failed": 0}

    def profiler(*args, **kwargs):
        calls["profiler"] += 1
        blocks = inner(*args, **kwargs)
        calls["failed"] += blocks is None
        return blocks

    manager.allocate_slots = profiler
    _victim_order_workload(harness, tokens)
    while harness.has_unfinished():
        harness.step()
        assert manager.allocate_slots is profiler
    assert calls["profiler"] > 0
    assert _first_preemption_order(harness)[:3] == ["anon", "bronze", "silver"]
    assert harness.requests["gold"].num_preemptions == 0
