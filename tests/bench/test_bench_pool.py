"""The pool twin: N engines (vLLM's real Scheduler + the KVQuota plugin + the sidecar's
admission each) behind a router model, quotas split evenly or by demand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvquota_lab.bench.pool import PoolSpec, run_pool, scale_load
from kvquota_lab.bench.router_choice import make_router
from kvquota_lab.bench.routers import (
    EngineLoad,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    prefix_hashes,
)
from kvquota_lab.bench.runner import BenchOptions, run_bench
from kvquota_lab.bench.scenario import generate_sessions, parse_scenario

IDLE = EngineLoad(kv_usage=0.0, waiting=0, running=0)

# One premium tenant whose sessions all start from one 600-token prompt: a prefix-aware
# router keeps them on the engine that has it, past that engine's even share.
HOT = """
name: pool-test-hot
description: one premium tenant whose sessions share a long prefix
seed: 3
duration: 20
drainTimeout: 120
engine: {capacityBlocks: 800, blockSize: 16, maxNumSeqs: 32, maxNumBatchedTokens: 1024,
         maxModelLen: 4096}
pool:
  tiers:
    premium: {maxQueueSeconds: 1}
tenants:
  acme:
    tier: premium
    kvCache: {guaranteedBlocks: "40%", maxBlocks: "50%"}
    workloads:
      chat:
        arrival: {process: steady, rate: 3}
        sharedPrefixTokens: 600
        promptTokens: {dist: uniform, low: 700, high: 900}
        outputTokens: 200
        maxTokens: 256
clients: {maxAttempts: 3, retryAfterSeconds: 1}
baseline: {dropTiers: []}
"""


def _request(prompt: list[int], tenant: str = "acme", session: str = "s1",
             salt: str | None = "acme") -> RouteRequest:
    return RouteRequest(tenant, session, prompt, salt)


# -- routers ------------------------------------------------------------------------


def test_round_robin_takes_engines_in_turn() -> None:
    router = RoundRobin()
    picks = [router.pick(_request([1] * 32), [IDLE] * 3) for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_least_kv_picks_the_emptiest_engine() -> None:
    router = make_router("least-kv", 3, block_size=16, capacity_blocks=100, model="m")
    loads = [EngineLoad(0.7, 0, 3), EngineLoad(0.2, 4, 1), EngineLoad(0.2, 1, 1)]
    assert router.pick(_request([1] * 32), loads) == 2  # equal KV: fewer waiting


def test_session_affinity_keeps_a_session_where_its_lease_is() -> None:
    router = SessionAffinity()
    first = router.pick(_request([1] * 32, session="a"), [EngineLoad(0.5, 0, 1), IDLE])
    assert first == 1
    busy_there = [IDLE, EngineLoad(0.9, 5, 9)]
    assert router.pick(_request([1] * 64, session="a"), busy_there) == 1
    assert router.pick(_request([1] * 32, session="b"), busy_there) == 0


def test_prefix_affinity_follows_the_prefix_and_only_the_same_tenants() -> None:
    router = PrefixAffinity(4, block_size=16, capacity_blocks=1000, model="m")
    shared = list(range(320))
    loads = [IDLE] * 4
    home = router.pick(_request(shared + [7] * 32, session="a"), loads)
    # Another session with the same prefix goes to the same engine, though it now runs
    # more than the others (a full prefix match outweighs some load).
    busier = [EngineLoad(0.3, 1, 1) if i == home else IDLE for i in range(4)]
    assert router.pick(_request(shared + [9] * 32, session="b"), busier) == home
    # Another tenant's cache salt: the same tokens hash differently, no affinity.
    assert router.pick(_request(shared, tenant="globex", salt="globex"), busier) != home
    assert (prefix_hashes(shared, 16, "m\0acme")[0]
            != prefix_hashes(shared, 16, "m\0globex")[0])
    # Without isolation (no salt) tenants share prefixes, as in the engine.
    assert prefix_hashes(shared, 16, "m\0") == prefix_hashes(shared, 16, "m\0")


def test_a_session_token_brings_a_follow_up_home_unless_home_is_full_and_queued() -> None:
    """The example picker configuration's session-affinity scorer (weight 3, above the
    prefix scorer's 2): a follow-up goes to the engine its session token names though
    another engine holds its whole prefix in the router's index (the token's engine
    does not: its entries were pushed out), unless that engine reads full and the
    most queued."""
    router = PrefixAffinity(3, block_size=16, capacity_blocks=1000, model="m")
    prompt = list(range(320))
    assert router.pick(_request(prompt, session="other"), [IDLE] * 3) == 0  # indexed on 0
    follow_up = RouteRequest("acme", "s", prompt, "acme", token_engine=2)
    assert router.pick(follow_up, [IDLE, IDLE, EngineLoad(1.0, 3, 9)]) == 0
    assert router.pick(follow_up, [IDLE, IDLE, EngineLoad(0.6, 0, 4)]) == 2


def test_a_kv_filter_sends_a_follow_up_away_from_a_home_with_no_room_left() -> None:
    """`--picker-kv-filter`: engines whose KV series reads the threshold or more are left
    out before scoring, though they hold the whole prefix and the session token names
    them; when every engine reads above it, scoring decides among all of them."""
    prompt = list(range(320))
    home_full = [EngineLoad(0.85, 0, 4), IDLE, IDLE]
    follow_up = RouteRequest("acme", "s", prompt, "acme", token_engine=0)
    for kv_filter, expected in ((None, 0), (0.9, 0), (0.8, 1)):
        router = PrefixAffinity(3, block_size=16, capacity_blocks=1000, model="m",
                                kv_filter=kv_filter)
        assert router.pick(_request(prompt, session="other"), [IDLE] * 3) == 0  # indexed
        assert router.pick(follow_up, home_full) == expected, kv_filter
    all_full = [EngineLoad(0.85, 0, 4), EngineLoad(0.9, 0, 4), EngineLoad(0.95, 0, 4)]
    assert router.pick(follow_up, all_full) == 0


def test_bad_pool_settings_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="round-robin, least-kv"):
        make_router("random", 2, block_size=16, capacity_blocks=10, model="m")
    with pytest.raises(ValueError, match="choose from even, demand"):
        PoolSpec(2, "least-kv", "uneven")
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        PoolSpec(0, "least-kv")
    with pytest.raises(ValueError, match=r"--picker-kv-filter must be in \(0, 1\], got 1.5"):
        PoolSpec(2, "prefix-affinity", kv_filter=1.5)
    with pytest.raises(ValueError, match="for --router prefix-affinity only"):
        PoolSpec(2, "least-kv", kv_filter=0.8)


# -- load ---------------------------------------------------------------------------


def test_load_scales_with_the_pool(tiny_scenario: Path) -> None:
    scenario = parse_scenario(tiny_scenario.read_text(), source=str(tiny_scenario))
    one, four = generate_sessions(scenario), generate_sessions(scale_load(scenario, 4))
    by_tenant = {t: sum(1 for s in four if s.tenant == t) for t in scenario.tenants}
    base = {t: sum(1 for s in one if s.tenant == t) for t in scenario.tenants}
    assert by_tenant["hobbyist"] == 4 * base["hobbyist"]  # bursts: 4x the size
    chat = scale_load(scenario, 4).tenants["acme"].workloads["chat"].arrival
    assert chat.rate == pytest.approx(4 * 0.3)  # type: ignore[union-attr]
    # Poisson at 1.2/s for 20 s: 24 expected, within three standard deviations (4.9).
    assert 24 - 3 * 4.9 <= by_tenant["acme"] <= 24 + 3 * 4.9
    assert scale_load(scenario, 4).engine == scenario.engine


# -- runs -----------------------------------------------------------------------------


def _pool_bench(scenario: str, **kwargs: Any) -> dict[str, Any]:
    options = BenchOptions(scenario=scenario, progress=False, jobs=1,
                           policies=("kvquota",), **kwargs)
    return run_bench(options)


@pytest.fixture(scope="module")
def round_robin(tiny_scenario_module: Path) -> dict[str, Any]:
    return _pool_bench(str(tiny_scenario_module), replicas=3, router="round-robin")


def test_a_pool_runs_every_request_on_its_engines(round_robin: dict[str, Any]) -> None:
    kvquota = round_robin["policies"]["kvquota:even:signals"]
    pool = kvquota["extra"]["pool"]
    assert kvquota["completed"] == kvquota["requests"] > 0
    assert sum(pool["requestsPerEngine"]) >= kvquota["requests"]  # retries route again
    assert max(pool["requestsPerEngine"]) - min(pool["requestsPerEngine"]) <= 1
    assert round_robin["baseline"]["completed"] == round_robin["baseline"]["requests"]
    assert pool["engineHours"] > 0


def test_the_same_pool_run_gives_the_same_document(
    tiny_scenario_module: Path, round_robin: dict[str, Any]
) -> None:
    again = _pool_bench(str(tiny_scenario_module), replicas=3, router="round-robin")
    assert {k: v for k, v in again.items() if k != "run"} == {
        k: v for k, v in round_robin.items() if k != "run"
    }


def test_session_affinity_keeps_conversations_cached(
    tiny_scenario_module: Path, round_robin: dict[str, Any]
) -> None:
    sticky = _pool_bench(str(tiny_scenario_module), replicas=3, router="session-affinity",
                         baseline=False)
    hit = {name: doc["policies"]["kvquota:even:signals"]["tiers"]["premium"]["prefixHitRate"]
           for name, doc in (("sticky", sticky), ("spread", round_robin))}
    # Round robin sends a follow-up turn to the engine that has its prefix one time in
    # three; the sticky router always does.
    assert hit["sticky"] > 0.8 > hit["spread"]


@pytest.fixture(scope="module")
def hot() -> dict[str, Any]:
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.metrics import summarize
    from kvquota_lab.bench.policies import POLICIES

    scenario = scale_load(parse_scenario(HOT, source="hot"), 2)
    out = {}
    for key, split, ledger in (("even", "even", False), ("demand", "demand", True),
                               ("even+ledger", "even", True)):
        spec = PoolSpec(2, "prefix-affinity", split, rebalance_interval=2.0, ledger=ledger)
        result = run_pool(scenario, POLICIES["kvquota"], spec, load_profile(scenario.profile))
        out[key] = summarize(result, scenario)
    return out


def test_an_even_split_refuses_a_tenant_within_its_pool_guarantee(
    hot: dict[str, Any]
) -> None:
    even = hot["even"]
    assert even["extra"]["pool"]["refusedWithinPoolGuarantee"]["premium"] >= 1
    # It was refused on the engine the router packs it onto, for its per-engine quota.
    assert even["tiers"]["premium"]["queuedSecondsBy"]["rejected_quota"] > 0


def test_the_pool_wide_ledger_admits_what_the_even_split_refused(
    hot: dict[str, Any]
) -> None:
    # The same even split with the shared ledger: the packed engine borrows the other's
    # idle share through the store, so no premium request is refused within its
    # pool-wide guarantee and its p99 falls (5.0 s -> 0.78 s when measured).
    even, ledger = hot["even"], hot["even+ledger"]
    assert ledger["extra"]["pool"]["refusedWithinPoolGuarantee"]["premium"] == 0
    assert ledger["extra"]["pool"]["ledger"]["admittedByStore"] > 0
    assert ledger["tiers"]["premium"]["ttftP99"] < even["tiers"]["premium"]["ttftP99"] / 2


def test_the_demand_split_moves_the_guarantee_where_the_tenant_is(
    hot: dict[str, Any]
) -> None:
    even, demand = hot["even"], hot["demand"]
    pool = demand["extra"]["pool"]
    assert pool["refusedWithinPoolGuarantee"]["premium"] == 0
    assert demand["tiers"]["premium"]["queuedSecondsBy"] == {}
    assert demand["tiers"]["premium"]["ttftP99"] < even["tiers"]["premium"]["ttftP99"] / 2
    # The pool-wide guarantee is unchanged (2 x 40% of 800), now where the work is.
    split = pool["finalSplit"]["acme"]
    assert sum(split) == 640 and split[0] > 320 > split[1]
    assert pool["policyUpdates"] > 0


def test_every_engine_enforces_its_own_entry_of_the_one_rendered_policy() -> None:
    # The twin renders one pool policy (the even entries and the per-engine overrides)
    # as the operator does; each engine's sidecar and plugin take their entry by name
    # (`EnginePolicy.for_engine`), as in a pod.
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.pool import PoolRun

    scenario = scale_load(parse_scenario(HOT, source="hot"), 2)
    spec = PoolSpec(2, "prefix-affinity", "demand", rebalance_interval=2.0)
    run = PoolRun(scenario, POLICIES["kvquota"], spec, load_profile(scenario.profile))
    run.run()
    assert set(run.policy.engines) == {"engine-0", "engine-1"}  # the split moved
    enforced, current = [], 0
    for engine in run.engines:
        mine = run.policy.for_engine(engine.name)
        assert engine.gateway is not None and engine.gateway.queue.policy == mine
        enforced.append(mine.tenants["acme"].guaranteed_blocks)
        # The plugin reloads its file between steps (an idle engine at its next one).
        plugin = engine.harness.plugin
        assert plugin is not None
        if plugin.kvq_policy_version == run.policy.version:
            assert plugin.kvq_policy == mine  # this engine's entry of the split
            current += 1
    assert enforced[0] != enforced[1] and sum(enforced) == 640
    assert current >= 1


# -- what the picker sees -------------------------------------------------------------

# Premium may hold 15% of an engine (120 blocks: one 66-block request at Full
# reservation, the next ones wait in the sidecar's queue); the free tier may fill 60%.
SEEN = """
name: pool-test-seen
description: premium's quota is full on one engine, free work fills the other
seed: 5
duration: 10
drainTimeout: 60
engine: {capacityBlocks: 800, blockSize: 16, maxNumSeqs: 32, maxNumBatchedTokens: 4096,
         maxModelLen: 4096}
pool:
  tiers:
    premium: {reservation: Full, maxQueueSeconds: 60}
    free: {reservation: Full}
tenants:
  acme:
    tier: premium
    kvCache: {guaranteedBlocks: "10%", maxBlocks: "15%", aboveMax: Never}
    workloads:
      chat:
        arrival: {process: steady, rate: 1}
        promptTokens: 800
        outputTokens: 200
        maxTokens: 256
  hobbyist:
    tier: free
    kvCache: {guaranteedBlocks: "5%", maxBlocks: "60%"}
    workloads:
      batch:
        arrival: {process: steady, rate: 1}
        promptTokens: 900
        outputTokens: 64
        maxTokens: 64
baseline: {dropTiers: []}
"""


def _picked_with(signals: str, tmp: Path) -> tuple[int, list[EngineLoad]]:
    """Engine 0: premium's quota full, three premium turns queued in its sidecar;
    engine 1: five free turns running. Where does the least-KV picker send premium's
    next turn, and what did it read?"""
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.pool import PoolRun

    scenario = parse_scenario(SEEN, source="seen")
    # No pool-wide ledger: it would admit these turns within premium's pool-wide
    # guarantee. Queued at its per-engine ceiling is what the picker must see.
    run = PoolRun(scenario, POLICIES["kvquota"],
                  PoolSpec(2, "least-kv", signals=signals, ledger=False),
                  load_profile(scenario.profile))
    premium = [s for s in run.sessions if s.tenant == "acme"]
    free = [s for s in run.sessions if s.tenant == "hobbyist"]
    run.open(tmp)
    try:
        busy, other = run.engines
        for engine, sessions in ((busy, premium[:4]), (other, free[:5])):
            for session in sessions:
                run.deliver(engine, (0.0, 0, session, 0, None))
            for _ in range(4):  # admitted turns prefill and run
                engine.turn()
        assert busy.gateway is not None and busy.gateway.queue.depth("acme") == 3
        nxt = (0.0, 0, premium[4], 0, None)
        loads = [e.load(premium[4].tier, signals) for e in run.engines]
        return run.pick(nxt).index, loads
    finally:
        run.close()


def test_a_picker_on_vllms_series_sends_premium_where_its_sidecar_queues(
    tmp_path: Path,
) -> None:
    picked, loads = _picked_with("vllm", tmp_path)
    # vLLM's series show engine 0 emptier (premium's one running turn) and no waiting:
    # the three premium turns in its sidecar's queue are invisible.
    assert picked == 0
    assert loads[0].waiting == 0 and loads[0].kv_usage < loads[1].kv_usage


def test_with_kvquotas_signals_the_picker_sees_premiums_queue_and_avoids_it(
    tmp_path: Path,
) -> None:
    picked, loads = _picked_with("kvquota", tmp_path)
    # Premium's series count its queued turns on engine 0, and leave out the free
    # tier's blocks on engine 1 (premium takes them back first).
    assert picked == 1
    assert loads[0].waiting == 3 and loads[1].waiting == 0
    assert loads[1].kv_usage < loads[0].kv_usage


def test_stock_engines_show_vllms_series_whatever_the_switch(tmp_path: Path) -> None:
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.pool import pool_tasks

    scenario = parse_scenario(SEEN, source="seen")
    tasks = pool_tasks(scenario, [POLICIES["priority"], POLICIES["kvquota"]], None,
                       replicas=2, router="least-kv", splits=("even", "demand"),
                       signals=("vllm", "kvquota"))
    pools = [task[2] for task in tasks if len(task) == 3]
    assert [(p.split, p.signals) for p in pools] == [
        ("even", "vllm"), ("even", "vllm"), ("even", "kvquota"),
        ("demand", "vllm"), ("demand", "kvquota"),
    ]
    with pytest.raises(ValueError, match="vllm, kvquota"):
        PoolSpec(2, "least-kv", signals="envoy")


class _Recorder:
    """A router that sends everything to engine 0 and keeps what it was asked."""

    name = "recorder"

    def __init__(self) -> None:
        self.requests: list[RouteRequest] = []

    def pick(self, request: RouteRequest, loads: Any) -> int:
        self.requests.append(request)
        return 0


@pytest.mark.parametrize(("router", "signals", "premium_max", "token"), [
    ("least-kv", "kvquota", "40%", 0),
    ("least-kv", "vllm", "40%", None),
    # 120 blocks: the first turn (66, prompt + max_tokens) leaves 54, not another turn.
    ("least-kv", "kvquota", "15%", None),
    # Behind the shipped llm-d picker its session-affinity scorer writes the pod it
    # picked on every response (v0.10.0 encoded_endpoint_header.go, unconditionally),
    # over the token the sidecar cleared.
    ("prefix-affinity", "kvquota", "15%", 0),
])
def test_a_leased_sessions_next_turn_carries_the_engine_that_admitted_the_last(
    router: str, signals: str, premium_max: str, token: int | None, tmp_path: Path,
) -> None:
    """The sidecar names its engine on a leased session's admitted responses while
    another turn of the session fits under its tenant's ceiling there, and clears the
    token once it does not (the load scorers then decide the next turn); the picker
    configuration that reads KVQuota's series scores it, vLLM's defaults do not (the
    token goes unread), and the shipped llm-d picker's scorer overwrites a cleared one."""
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.pool import PoolRun

    seen = SEEN.replace('maxBlocks: "15%"', f'maxBlocks: "{premium_max}"')
    scenario = parse_scenario(seen, source="seen")
    run = PoolRun(scenario, POLICIES["kvquota"], PoolSpec(2, router, signals=signals),
                  load_profile(scenario.profile))
    assert run.policy.tenants["acme"].lease.seconds > 0
    recorder = _Recorder()
    run.router = recorder
    session = next(s for s in run.sessions if s.tenant == "acme")
    run.open(tmp_path)
    try:
        run.deliver(run.pick((0.0, 0, session, 0, None)), (0.0, 0, session, 0, None))
        for _ in range(3):
            run.engines[0].turn()
        run.prompts[(session.session_id, 1)] = session.first_prompt() + [7] * 32
        run.pick((1.0, 0, session, 1, None))
    finally:
        run.close()
    first, follow_up = recorder.requests
    assert first.token_engine is None  # a first turn has no token yet
    assert follow_up.token_engine == token


def test_the_pool_is_compared_with_one_engine_on_as_many_seeds(
    tiny_scenario_module: Path, round_robin: dict[str, Any]
) -> None:
    """Three engines: three single-engine KVQuota runs from the pool's seed (1) on, their
    premium turns pooled; the pool's p99 over that p99 is its `x 1 engine`."""
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.one_engine import tier_ttfts
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.scenario import load_scenario
    from kvquota_lab.bench.twin import run_twin
    from kvquota_lab.percentile import percentile

    pooled: list[float] = []
    for seed in (1, 2, 3):
        scenario = load_scenario(str(tiny_scenario_module), seed=seed)
        pooled += tier_ttfts(run_twin(scenario, generate_sessions(scenario),
                                      POLICIES["kvquota"], load_profile(scenario.profile)),
                             "premium")
    reference = round_robin["comparison"]["oneEngine"]
    assert reference["seeds"] == [1, 2, 3] and reference["turns"] == len(pooled)
    assert reference["ttftP99"] == pytest.approx(percentile(pooled, 99), abs=1e-4)
    p99 = round_robin["policies"]["kvquota:even:signals"]["tiers"]["premium"]["ttftP99"]
    assert round_robin["comparison"]["ttftP99VsOneEngine"]["kvquota:even:signals"] == \
        pytest.approx(p99 / reference["ttftP99"], abs=1e-3)


def test_the_report_tells_a_split_that_refuses_with_room_from_a_quota_that_binds(
    hot: dict[str, Any]
) -> None:
    """The even split refuses premium on one engine's share while the pool-wide maxBlocks
    has room: every such 429 is counted with room; the ledger leaves none."""
    even = hot["even"]["extra"]["pool"]["ownMaxBlocks"]["acme"]
    assert even["maxBlocks"] == 800  # 50% of 800 blocks, x 2 engines
    assert even["refusedOnMaxBlocks"] == even["refusedWithRoom"] > 0
    assert even["secondsQueuedWithRoom"] > 0
    ledger = hot["even+ledger"]["extra"]["pool"]["ownMaxBlocks"]["acme"]
    assert ledger["refusedWithRoom"] == 0 and ledger["secondsQueuedWithRoom"] == 0
    assert hot["even+ledger"]["tiers"]["premium"]["besideIdleKvSeconds"] == 0
