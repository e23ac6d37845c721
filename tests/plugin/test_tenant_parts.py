"""The plugin's pure policy (no vLLM): identity, leases, victim ranking, policy file,
stats rendering and the stats channel."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeClock
from plugin_policies import engine_policy, tenant, write_policy

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.reclaim import Band
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.plugin.policy_watch import PolicyWatcher
from engine_sidecar.plugin.rules.counters import stats_tenant
from engine_sidecar.plugin.rules.degraded import DegradedEpisodes
from engine_sidecar.plugin.rules.identity import NO_IDENTITY, Identity, identity_from_extra_args
from engine_sidecar.plugin.rules.leases import Lease, LeaseDrop, LeaseTable
from engine_sidecar.plugin.rules.pauses import SessionPauses
from engine_sidecar.plugin.rules.ranking import Reason, VictimRanker
from engine_sidecar.plugin.stats_publisher import LeaseView, StatsPublisher, StatsSnapshot

# -- identity -----------------------------------------------------------------------------


def test_identity_comes_from_the_sidecar_extra_args():
    assert identity_from_extra_args({"kvq_tenant": "acme", "kvq_session": "s1"}) == Identity(
        "acme", "s1"
    )
    assert identity_from_extra_args({"kvq_tenant": "acme"}).session_key is None


@pytest.mark.parametrize("extra_args", [
    None, {}, {"kvq_session": "s1"}, {"kvq_tenant": ""}, {"kvq_tenant": 7},
    {"kvq_tenant": "x" * 300},
])
def test_requests_without_a_usable_tenant_are_unclassified(extra_args):
    assert identity_from_extra_args(extra_args) is NO_IDENTITY


def test_unknown_tenants_share_one_stats_bucket():
    policy = engine_policy(tenant("acme"))
    assert stats_tenant(policy, "acme") == "acme"
    assert stats_tenant(policy, "someone-else") == "_unclassified"
    assert stats_tenant(None, "acme") == "_unclassified"


# -- victim ranking -------------------------------------------------------------------------


def _ranked(ranker: VictimRanker, candidates: dict[str, tuple]) -> list[str]:
    """Candidate names, first victim first."""
    return sorted(candidates, key=lambda name: candidates[name], reverse=True)


def test_victim_order_is_band_then_tier_then_leases_then_least_work():
    policy = engine_policy(
        tenant("gold", "premium", guaranteed=100),
        tenant("silver", "standard", guaranteed=100),
        tenant("bronze", "free", guaranteed=100),
        tenant("greedy", "premium", guaranteed=10),
    )
    ranker = VictimRanker(policy, {"gold": 50, "silver": 50, "bronze": 50, "greedy": 40})
    lease = Lease[object]
    candidates = {
        "anon-old": ranker.running_key(None, 0, 500, arrival_time=1.0),
        "anon-new": ranker.running_key(None, 0, 10, arrival_time=2.0),
        "greedy-borrower": ranker.running_key("greedy", 0, 10, arrival_time=1.0),
        "bronze-much-work": ranker.running_key("bronze", 2, 900, arrival_time=1.0),
        "bronze-little-work": ranker.running_key("bronze", 2, 20, arrival_time=0.5),
        "bronze-lease": ranker.lease_key(lease("bronze", "s", [], 5.0, 99.0)),
        "silver": ranker.running_key("silver", 1, 20, arrival_time=1.0),
        "gold-lease-old": ranker.lease_key(lease("gold", "a", [], 1.0, 99.0)),
        "gold-lease-new": ranker.lease_key(lease("gold", "b", [], 9.0, 99.0)),
        "gold-same-work-old": ranker.running_key("gold", 0, 100, arrival_time=1.0),
        "gold-same-work-new": ranker.running_key("gold", 0, 100, arrival_time=3.0),
    }
    assert _ranked(ranker, candidates) == [
        "anon-new",  # unclassified: vLLM's own order (priority, newest arrival)
        "anon-old",
        "greedy-borrower",  # above its guarantee, though premium
        "bronze-lease",  # free tier: idle lease before running work
        "bronze-little-work",  # least computed work first
        "bronze-much-work",
        "silver",
        "gold-lease-old",  # oldest lease first
        "gold-lease-new",
        "gold-same-work-new",  # same work: newest arrival first
        "gold-same-work-old",
    ]


def test_unclassified_ranking_matches_vllm_priority_victim():
    ranker = VictimRanker(None, {})
    requests = [(2, 1.0), (0, 5.0), (2, 3.0), (1, 9.0)]  # (priority, arrival)
    ours = max(requests, key=lambda r: ranker.running_key(None, r[0], 0, r[1]))
    assert ours == max(requests)  # vLLM: max(running, key=(priority, arrival_time))


def test_releasing_blocks_can_end_borrowing():
    policy = engine_policy(tenant("gold", guaranteed=100))
    ranker = VictimRanker(policy, {"gold": 120})
    assert ranker.running_key("gold", 0, 0, 0.0)[0] == Band.BORROWER
    ranker.debit("gold", 30)
    assert ranker.running_key("gold", 0, 0, 0.0)[0] == Band.GUARANTEED
    assert ranker.running_reason(ranker.running_key("gold", 0, 0, 0.0)) is Reason.TIER
    assert ranker.running_reason(ranker.running_key(None, 0, 0, 0.0)) is Reason.UNCLASSIFIED


# -- leases -------------------------------------------------------------------------------


def _lease(
    tenant_id: str, session: str, blocks: int, at: float, seconds: float = 60, first: int = 0
):
    """A lease of blocks `first` .. `first + blocks - 1` (the same ids: the same blocks)."""
    return Lease(tenant_id, session, list(range(first, first + blocks)), at, at + seconds)


def test_lease_expiry_and_renewal():
    table: LeaseTable[int] = LeaseTable()
    policy = engine_policy(tenant("acme", lease_seconds=60))
    assert table.put(_lease("acme", "a", 5, at=0.0), policy) == []
    old = table.get(("acme", "a"))
    renewed = table.put(_lease("acme", "a", 7, at=10.0), policy)
    assert renewed == [(old, None)]  # a renewal, not a drop
    table.touch(("acme", "a"), now=40.0, seconds=60)
    assert table.pop_expired(99.0) == []
    assert [lease.key for lease in table.pop_expired(100.0)] == [("acme", "a")]
    assert len(table) == 0


def test_lease_caps_drop_the_oldest_sessions_of_that_tenant():
    table: LeaseTable[int] = LeaseTable()
    policy = engine_policy(
        tenant("acme", lease_seconds=60, lease_sessions=2),
        tenant("other", lease_seconds=60, lease_blocks=10),
    )
    table.put(_lease("other", "x", 4, at=0.0), policy)
    table.put(_lease("acme", "a", 4, at=1.0), policy)
    table.put(_lease("acme", "b", 4, at=2.0), policy)
    dropped = table.put(_lease("acme", "c", 4, at=3.0), policy)
    assert [(lease.key, why) for lease, why in dropped] == [(("acme", "a"), LeaseDrop.CAP)]
    dropped = table.put(_lease("other", "y", 8, at=4.0, first=100), policy)  # 12 > 10
    assert [(lease.key, why) for lease, why in dropped] == [(("other", "x"), LeaseDrop.CAP)]
    assert table.tenant_totals() == {"acme": (2, 8), "other": (1, 8)}


def test_the_block_cap_counts_a_shared_prefix_once():
    # Six sessions over one 8-block system prompt, 2 blocks of their own each: vLLM
    # holds 8 + 6 * 2 = 20 distinct blocks, not 6 * 10 = 60, and all fit a cap of 20.
    table: LeaseTable[int] = LeaseTable()
    policy = engine_policy(tenant("acme", lease_seconds=60, lease_blocks=20))
    for n in range(6):
        own = [100 + 2 * n, 101 + 2 * n]
        lease = Lease("acme", f"s{n}", [*range(8), *own], float(n), n + 60.0)
        assert table.put(lease, policy) == []
    assert table.pinned_blocks("acme") == 20
    # A seventh session's 2 own blocks break the cap: the oldest session goes, and
    # only its own blocks stop counting (the prefix is still pinned by the others).
    dropped = table.put(Lease("acme", "s6", [*range(8), 200, 201], 6.0, 66.0), policy)
    assert [(lease.key, why) for lease, why in dropped] == [(("acme", "s0"), LeaseDrop.CAP)]
    assert table.pinned_blocks("acme") == 20
    assert [lease.key for lease in table.pop_expired(61.0)] == [("acme", "s1")]
    assert table.pinned_blocks("acme") == 18
    table.pop_all()
    assert table.pinned_blocks("acme") == 0


def _pauses(gaps: list[float]) -> SessionPauses:
    pauses = SessionPauses()
    now = 0.0
    for n, gap in enumerate(gaps):
        key = ("acme", f"s{n % 4}")
        pauses.turn_ended(key, now)
        now += gap
        pauses.turn_started(key, now)
    return pauses


def test_leases_of_sessions_with_a_rhythm_go_to_those_about_to_return():
    rng = random.Random(3)
    # People reading answers of similar length: pauses 60-100 s (CV 0.14) keep a rhythm;
    # exponential think times (CV 1) do not.
    regular = _pauses([rng.uniform(60, 100) for _ in range(40)])
    irregular = _pauses([rng.expovariate(1 / 80) for _ in range(40)])
    assert regular.regular("acme") and not irregular.regular("acme")
    assert not _pauses([80.0] * 10).regular("acme")  # too few pauses to say
    # Three sessions that left 30, 20 and 10 s ago pause 80 s: they come back in that
    # order, so a fourth one, just left, is the one a 3-session cap gives up ...
    policy = engine_policy(tenant("acme", lease_seconds=300, lease_sessions=3))
    table: LeaseTable[int] = LeaseTable()
    for n, left in enumerate((0.0, 10.0, 20.0)):
        lease = _lease("acme", f"s{n}", 2, at=left, first=10 * n)
        lease.pause = regular.return_pause(("acme", f"s{n}"))
        table.put(lease, policy)
    newest = _lease("acme", "s3", 2, at=30.0, first=30)
    newest.pause = 80.0
    assert [(lease.key, why) for lease, why in table.put(newest, policy)] == [
        (("acme", "s3"), LeaseDrop.CAP)
    ]
    # ... where without a rhythm the oldest goes, the likeliest to have been abandoned.
    table = LeaseTable()
    for n, left in enumerate((0.0, 10.0, 20.0, 30.0)):
        dropped = table.put(_lease("acme", f"s{n}", 2, at=left, first=10 * n), policy)
    assert [(lease.key, why) for lease, why in dropped] == [(("acme", "s0"), LeaseDrop.CAP)]


def test_a_policy_change_re_derives_expiry_and_drops_withdrawn_leases():
    table: LeaseTable[int] = LeaseTable()
    v1 = engine_policy(tenant("acme", lease_seconds=60), tenant("gone", lease_seconds=60))
    table.put(_lease("acme", "a", 3, at=0.0), v1)
    table.put(_lease("gone", "g", 3, at=0.0), v1)
    v2 = engine_policy(tenant("acme", lease_seconds=10))
    assert [(lease.key, why) for lease, why in table.apply_policy(v2)] == [
        (("gone", "g"), LeaseDrop.POLICY)
    ]
    assert [lease.key for lease in table.pop_expired(10.0)] == [("acme", "a")]


def test_degraded_episode_is_logged_once():
    lines: list[str] = []
    episodes = DegradedEpisodes(log=lambda msg, *args: lines.append(msg % args))
    episodes.note_release("gold", 10)
    episodes.note_release("gold", 12)
    assert episodes.end_step(allocation_failed=True) is False
    assert episodes.end_step(allocation_failed=False) is True
    episodes.note_release("gold", 3)
    assert episodes.episodes == 2
    assert len(lines) == 2


# -- policy file ----------------------------------------------------------------------------


def test_policy_watcher_reloads_changes_at_most_every_half_second(tmp_path: Path):
    path, clock = tmp_path / "policy.json", FakeClock()
    v1, v2 = engine_policy(tenant("a")), engine_policy(tenant("b"))
    write_policy(path, v1)
    watcher = PolicyWatcher(path, clock=clock)
    assert watcher.poll() and watcher.version == v1.version
    write_policy(path, v2)
    clock.now = 0.4
    assert not watcher.poll() and watcher.version == v1.version
    clock.now = 0.5
    assert watcher.poll() and watcher.version == v2.version
    clock.now = 1.0
    assert not watcher.poll()  # unchanged file


def test_policy_watcher_keeps_the_last_good_policy(tmp_path: Path, caplog):
    caplog.set_level(logging.ERROR)
    path, clock = tmp_path / "policy.json", FakeClock()
    good = engine_policy(tenant("a"))
    write_policy(path, good)
    watcher = PolicyWatcher(path, clock=clock)
    watcher.poll()
    for raw in ('{"broken', '{"broken"}'):  # two bad versions of the file
        path.write_text(raw)
        for _ in range(3):  # polled again and again: logged once
            clock.now += 1
            assert not watcher.poll()
        assert watcher.version == good.version
        assert watcher.error and watcher.error.startswith("invalid policy file")
    tampered = json.loads(good.to_json()) | {"watermark": 0.3}  # version no longer matches
    path.write_text(json.dumps(tampered))
    clock.now += 1
    watcher.poll()
    assert "does not match its content" in (watcher.error or "")
    assert watcher.version == good.version
    path.unlink()
    clock.now += 1
    watcher.poll()
    assert "missing" in (watcher.error or "") and watcher.version == good.version
    assert len([r for r in caplog.records if "invalid policy" in r.getMessage()]) == 3


def test_no_policy_file_means_no_policy_and_no_error(tmp_path: Path):
    watcher = PolicyWatcher(tmp_path / "absent.json", clock=FakeClock())
    assert not watcher.poll()
    assert watcher.policy is None and watcher.error is None


# -- stats channel ------------------------------------------------------------------------


def _snapshot() -> StatsSnapshot:
    stats = EngineStats(
        timestamp=0.0, policy_version="v1", total_blocks=100, free_blocks=50,
        tenants={"acme": TenantEngineStats(leased_blocks=30, leased_sessions=2)},
    )
    return StatsSnapshot(stats, (
        LeaseView("acme", "s1", last_activity=0.0, expires_at=60.0, exclusive_blocks=10),
        LeaseView("acme", "s2", last_activity=30.0, expires_at=90.0, exclusive_blocks=20),
    ))


def test_idle_stats_take_expired_leases_off_the_books():
    at_70 = _snapshot().render(70.0, 123.0)
    assert at_70.timestamp == 123.0
    assert at_70.tenants["acme"].leased_sessions == 1
    assert at_70.tenants["acme"].leased_blocks == 20
    assert at_70.free_blocks == 60


def test_idle_stats_report_the_policy_the_next_step_applies():
    v2 = engine_policy(tenant("acme", lease_seconds=10), tenant("new"))
    stats = _snapshot().render(20.0, 0.0, policy=v2)
    assert stats.policy_version == v2.version
    assert "new" in stats.tenants
    # Under v2 the first lease expired at 10 s; the second lives until 40 s.
    assert stats.tenants["acme"].leased_sessions == 1
    errored = _snapshot().render(20.0, 0.0, policy=None, policy_error="invalid policy file x")
    assert errored.policy_version == "v1" and errored.policy_error == "invalid policy file x"


def test_publisher_writes_the_latest_snapshot(tmp_path: Path):
    path = tmp_path / "stats.json"
    publisher = StatsPublisher(path, clock=lambda: 0.0, heartbeat=0.05)
    try:
        publisher.publish(_snapshot())
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        first = EngineStats.model_validate_json(path.read_text())
        assert first.policy_version == "v1"
    finally:
        publisher.close()
    assert EngineStats.model_validate_json(path.read_text()).free_blocks == 50


def test_policy_watcher_enforces_its_own_engines_split_else_the_even_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "policy.json"
    even = tenant("acme", guaranteed=200, max_blocks=300)
    policy = EnginePolicy.model_validate({
        **engine_policy(even, tenant("other", guaranteed=50)).model_dump(),
        "engines": {"engine-a": {"acme": {"guaranteed_blocks": 350, "max_blocks_per_engine": 450}},
                    "engine-b": {"acme": {"guaranteed_blocks": 50, "max_blocks_per_engine": 150}}},
        "version": "",
    }).with_version()
    write_policy(path, policy)

    def seen(**kwargs: Any) -> tuple[int, int, int, str | None]:
        watcher = PolicyWatcher(path, clock=FakeClock(), **kwargs)
        watcher.poll()
        assert watcher.policy is not None
        acme = watcher.policy.tenants["acme"]
        return (acme.guaranteed_blocks, acme.max_blocks_per_engine,
                watcher.policy.tenants["other"].guaranteed_blocks, watcher.version)

    assert seen(engine="engine-a") == (350, 450, 50, policy.version)  # same version
    assert seen(engine="engine-b") == (50, 150, 50, policy.version)
    assert seen(engine="engine-new") == (200, 300, 50, policy.version)  # not in the split
    monkeypatch.delenv("POD_NAME", raising=False)
    assert seen() == (200, 300, 50, policy.version)  # unnamed: the even split
    monkeypatch.setenv("POD_NAME", "engine-a")  # the env var the injected pod sets
    assert seen() == (350, 450, 50, policy.version)


@pytest.mark.parametrize("pauses_seen", [1, 2, 3, 5, 10, 30])
def test_a_returning_session_rarely_finds_its_lease_gone_however_few_pauses_it_showed(
    pauses_seen: int,
):
    # Exponential think times with a mean of 100 s (MIN_HOLD_S never decides): after
    # `pauses_seen` pauses, how often does the next one outlast the lease? The rule
    # promises e^-4 (1.8%) for a plain mean and approximates it for the weighted one;
    # 3% allows for that and for 4,000 draws (binomial sd 0.2 points).
    rng = random.Random(pauses_seen)
    trials, lapsed, lapsed_at_4x = 4000, 0, 0
    for trial in range(trials):
        pauses, key, now = SessionPauses(), ("acme", f"s{trial}"), 0.0
        for _ in range(pauses_seen):
            pauses.turn_ended(key, now)
            now += rng.expovariate(1 / 100)
            pauses.turn_started(key, now)
        nxt = rng.expovariate(1 / 100)
        lapsed += nxt > pauses.hold_seconds(key)
        lapsed_at_4x += nxt > 4 * pauses.session_pause(key)
    assert lapsed / trials < 0.03
    if pauses_seen == 1:
        # Four times one observed pause, the rule before the estimate's own spread was
        # counted, loses one lease in five: (1 + 4)^-1.
        assert lapsed_at_4x / trials > 0.15
