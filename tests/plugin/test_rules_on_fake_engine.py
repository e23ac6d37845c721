"""The plugin's parts (`TenantPlugin`, `VictimOrder`, `Reclaim`, leases, prefill order)
built on an engine in memory: each rule's decision, without vLLM.

tests/plugin/test_scheduler_scenarios.py and its siblings prove the same behaviour on
vLLM's real Scheduler; here each rule is cornered in a few lines (fake_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fake_engine import MARKED_PRIORITY, FakeClock, FakeEngine, FakeRequest
from plugin_policies import engine_policy, tenant, write_policy

from engine_sidecar.contract.policy import TenantPolicy
from engine_sidecar.contract.stats import TenantEngineStats
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.core.engine_port import Phase
from engine_sidecar.plugin.core.tenant_plugin import TenantPlugin

Build = Callable[..., tuple[TenantPlugin, FakeEngine, FakeClock]]


@pytest.fixture
def build(tmp_path: Path) -> Build:
    def make(*tenants: TenantPolicy, num_blocks: int = 40, steer: bool = True,
             ) -> tuple[TenantPlugin, FakeEngine, FakeClock]:
        path = tmp_path / "policy.json"
        if tenants:
            write_policy(path, engine_policy(*tenants))
        clock, engine = FakeClock(), FakeEngine(num_blocks)
        plugin = engine.build_plugin(PluginConfig(policy_path=path, clock=clock),
                                     steer_victims=steer)
        return plugin, engine, clock

    return make


def _allocate_in_step(plugin: TenantPlugin, engine: FakeEngine, request: FakeRequest,
                      num_blocks: int) -> bool:
    """One allocation in a step, as vLLM's scheduler makes it: a running request that
    finds no room preempts vLLM's victim until it fits or is the victim itself."""
    plugin.step_starting()
    try:
        while engine.allocate(request, num_blocks,
                              on_failure=plugin.reclaim.on_allocation_failure) is None:
            if request.phase is not Phase.RUNNING or engine.preempt() is request:
                return False
        return True
    finally:
        plugin.step_ended()


def _turn(engine: FakeEngine, req_id: str, tenant_id: str, session: str,
          num_blocks: int) -> FakeRequest:
    """A finished turn of `session` that left `num_blocks` cached blocks."""
    request = engine.add(req_id, tenant=tenant_id, session=session,
                         prompt_blocks=num_blocks)
    assert engine.allocate(request, num_blocks) is not None
    engine.finish(request)
    return request


def _stats(plugin: TenantPlugin) -> dict[str, TenantEngineStats]:
    return plugin.snapshot().stats.tenants


# -- victim order -------------------------------------------------------------------------


def test_victims_go_unclassified_then_borrower_then_lower_tier(build: Build):
    plugin, engine, _ = build(
        tenant("gold", "premium", guaranteed=100),
        tenant("silver", "standard", guaranteed=100),
        tenant("bronze", "free", guaranteed=0),  # any usage is borrowed
    )
    # The unclassified request has vLLM priority 0 and the oldest arrival: vLLM's own
    # priority policy would preempt it last.
    for i, (name, priority) in enumerate([("anon", 0), ("gold", 0), ("silver", 1),
                                          ("bronze", 2)]):
        request = engine.add(name, tenant=None if name == "anon" else name,
                             priority=priority, arrival_time=i)
        engine.allocate(request, 10)
    gold = engine.requests["gold"]
    for _ in range(3):
        assert _allocate_in_step(plugin, engine, gold, 10)
        assert all(r.priority < MARKED_PRIORITY for r in engine.requests.values())

    assert engine.preempted == ["anon", "bronze", "silver"]
    stats = _stats(plugin)
    assert stats["_unclassified"].preemptions == {"unclassified": 1}
    assert stats["bronze"].preemptions == {"borrower": 1}
    assert stats["silver"].preemptions == {"tier": 1}


def test_within_a_class_the_victim_loses_the_least_work(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100), num_blocks=30)
    short = engine.add("short", tenant="gold", arrival_time=0)
    long = engine.add("long", tenant="gold", arrival_time=1)
    engine.allocate(short, 8)
    engine.allocate(long, 22)

    assert _allocate_in_step(plugin, engine, long, 1)
    assert engine.preempted == ["short"]


def test_under_fcfs_vllm_keeps_its_victim_and_the_plugin_marks_none(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=0), tenant("bronze", "free",
                              guaranteed=100), num_blocks=20, steer=False)
    gold = engine.add("gold", tenant="gold", priority=0, arrival_time=0)
    bronze = engine.add("bronze", tenant="bronze", priority=2, arrival_time=1)
    engine.allocate(gold, 10)
    engine.allocate(bronze, 10)

    assert _allocate_in_step(plugin, engine, gold, 1)
    assert engine.preempted == ["bronze"]  # vLLM's pick, not the borrowing gold
    assert plugin.victims.marked == {}


# -- leases under pressure ------------------------------------------------------------------


def test_an_expired_lease_goes_before_any_running_work(build: Build):
    plugin, engine, clock = build(tenant("gold", guaranteed=100, lease_seconds=10),
                                  num_blocks=20)
    _turn(engine, "turn-1", "gold", "s", 10)
    running = engine.add("other", tenant="gold", session="t")
    engine.allocate(running, 10)
    clock.now = 5.0
    plugin.step_starting()
    clock.now = 11.0  # the lease expires while the step runs
    try:
        assert engine.allocate(running, 5, on_failure=plugin.reclaim.on_allocation_failure)
    finally:
        plugin.step_ended()

    assert engine.preempted == []
    assert _stats(plugin)["gold"].lease_drops == {"expired": 1}


def test_a_lower_tier_lease_breaks_before_running_work_gives_way(build: Build):
    plugin, engine, _ = build(
        tenant("gold", "premium", guaranteed=100, lease_seconds=300),
        tenant("silver", "standard", guaranteed=100, lease_seconds=300),
        num_blocks=40,
    )
    _turn(engine, "silver-1", "silver", "s", 10)
    _turn(engine, "gold-1", "gold", "g", 10)
    gold = engine.add("gold-2", tenant="gold", session="g2")
    engine.allocate(gold, 20)

    assert _allocate_in_step(plugin, engine, gold, 5)
    assert engine.preempted == []
    stats = _stats(plugin)
    assert stats["silver"].lease_breaks == 1
    assert stats["silver"].preemptions == {"lease_break": 1}
    assert stats["gold"].lease_breaks == 0 and stats["gold"].leased_sessions == 1


def test_degraded_mode_releases_the_oldest_premium_lease_when_nothing_else_gives_way(
    build: Build,
):
    plugin, engine, clock = build(
        tenant("gold", "premium", guaranteed=100, lease_seconds=300),
        tenant("bronze", "free", guaranteed=0),
        num_blocks=30,
    )
    for i in range(3):
        clock.now = float(i)
        _turn(engine, f"gold-{i}", "gold", f"s{i}", 10)
    bronze = engine.add("bronze", tenant="bronze", priority=2)

    assert engine.allocate(bronze, 5, on_failure=plugin.reclaim.on_allocation_failure)
    assert plugin.state.degraded.active
    assert plugin.state.leases.get(("gold", "s0")) is None  # the oldest went
    assert len(plugin.state.leases) == 2
    gold = _stats(plugin)["gold"]
    assert gold.preemptions == {"degraded": 1} and gold.degraded_events == 1
    assert plugin.reclaim.end_step() is True  # the failure is the step's
    plugin.step_ended()
    assert not plugin.state.degraded.active  # a step without failure ends the episode


def test_a_tenants_own_idle_leases_make_way_for_its_new_request(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100, lease_seconds=300),
                              num_blocks=20)
    _turn(engine, "gold-1", "gold", "s1", 10)
    _turn(engine, "gold-2", "gold", "s2", 10)
    new = engine.add("gold-3", tenant="gold", session="s3")

    assert engine.allocate(new, 10, on_failure=plugin.reclaim.on_allocation_failure)
    assert len(plugin.state.leases) == 1
    assert _stats(plugin)["gold"].lease_breaks == 1


# -- a waiting request and the work ranked above it ---------------------------------------


def test_work_ranked_above_a_waiting_request_is_preempted_before_the_next_step(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100),
                              tenant("bronze", "free", guaranteed=0), num_blocks=20)
    for i in range(2):
        engine.allocate(engine.add(f"bronze-{i}", tenant="bronze", priority=2,
                                   arrival_time=i), 10)
    gold = engine.add("gold", tenant="gold", arrival_time=5)

    assert not _allocate_in_step(plugin, engine, gold, 8)  # vLLM leaves it waiting
    assert engine.preempted == [] and gold.phase is Phase.QUEUED
    plugin.step_starting()  # before the next step: one bronze gives way, 10 blocks
    plugin.step_ended()
    assert engine.preempted == ["bronze-1"]  # the newest of equals, as vLLM would
    assert plugin.reclaim.stuck is None
    assert engine.allocate(gold, 8) is not None


def test_a_waiting_request_nothing_ranks_above_does_not_preempt_anyone(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100),
                              tenant("bronze", "free", guaranteed=100), num_blocks=20)
    engine.allocate(engine.add("gold-1", tenant="gold"), 20)
    bronze = engine.add("bronze", tenant="bronze", priority=2, arrival_time=1)

    assert not _allocate_in_step(plugin, engine, bronze, 5)
    plugin.step_starting()
    plugin.step_ended()
    assert engine.preempted == []


# -- leases ---------------------------------------------------------------------------------


def test_a_finished_turn_pins_its_cached_blocks_and_the_next_turn_renews_the_lease(
    build: Build,
):
    plugin, engine, clock = build(tenant("gold", guaranteed=100, lease_seconds=60))
    turn = _turn(engine, "turn-1", "gold", "s", 5)
    lease = plugin.state.leases.get(("gold", "s"))
    assert lease is not None and lease.expires_at == 60.0
    assert engine.free_block_count() == 35  # pinned, out of the free queue
    assert _stats(plugin)["gold"].leased_blocks == 5

    clock.now = 30.0
    follow_up = engine.add("turn-2", tenant="gold", session="s", prompt_blocks=6)
    assert lease.expires_at == 90.0
    assert engine.allocate(follow_up, 1, prefix=lease.blocks) is not None
    assert follow_up.blocks[:5] == lease.blocks and turn.blocks == []
    # The running turn and its lease share 5 blocks: they count once.
    assert _stats(plugin)["gold"].running_blocks == 6
    assert _stats(plugin)["gold"].leased_blocks == 0


def test_a_turn_that_failed_leaves_no_lease(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100, lease_seconds=60))
    request = engine.add("turn-1", tenant="gold", session="s", prompt_blocks=5)
    engine.allocate(request, 5)
    engine.finish(request, Phase.DISCARDED)
    assert len(plugin.state.leases) == 0 and engine.free_block_count() == 40


def test_a_prefix_cache_reset_drops_every_lease(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100, lease_seconds=60))
    _turn(engine, "turn-1", "gold", "s", 5)
    plugin.prefix_cache_resetting()
    assert engine.free_block_count() == 40
    assert _stats(plugin)["gold"].lease_drops == {"reset": 1}


# -- prefill order --------------------------------------------------------------------------


def test_lower_priority_prefill_chunks_sit_out_the_step_of_a_premium_prefill(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=100),
                              tenant("bronze", "free", guaranteed=100))
    for name, priority in (("gold", 0), ("bronze", 2)):
        request = engine.add(name, tenant=name, priority=priority, prompt_blocks=8)
        engine.allocate(request, 2)  # 2 of 8 blocks computed: still prefilling
    plugin.step_starting()
    plugin.step_ended()
    assert engine.skipped == ["bronze"]


def test_a_waiting_request_reclaim_could_not_serve_holds_no_prefill_back(build: Build):
    plugin, engine, _ = build(tenant("gold", guaranteed=0),
                              tenant("bronze", "free", guaranteed=100), num_blocks=20)
    engine.allocate(engine.add("anon", priority=1), 2)
    bronze = engine.add("bronze", tenant="bronze", priority=2, prompt_blocks=30,
                        arrival_time=1)
    engine.allocate(bronze, 18)  # still prefilling
    gold = engine.add("gold", tenant="gold", arrival_time=2)  # would borrow
    plugin.step_starting()
    plugin.step_ended()
    assert engine.skipped == ["bronze"]  # gold waits first in line

    assert not _allocate_in_step(plugin, engine, gold, 8)
    engine.skipped.clear()
    plugin.step_starting()  # only the unclassified request ranks above gold: not enough
    plugin.step_ended()
    assert engine.preempted == ["anon"] and plugin.reclaim.stuck is gold
    assert engine.skipped == []
