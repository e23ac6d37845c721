"""The pool twin: N twin engines behind a router, the quotas split evenly or by demand.

Each engine is what `twin.TwinRun` runs for one engine (vLLM's real Scheduler with the
KVQuota plugin, and the sidecar's real admission queue), on its own virtual clock; a
router model (`routers`) sends every turn, first or retried, to one of them. The
engines share the sessions: a conversation's context follows it to whichever engine
its next turn lands on (without its cached prefix, unless it lands where it was).

The quotas are the scenario's per engine (its percentages are of one engine's
capacity), so a tenant's pool-wide guarantee is `replicas x` its per-engine one, and
the load scales with the pool (`scale_load`: arrival rates and burst sizes x N, done
by the caller, so the report counts the sessions that ran). With
`split="even"` every engine keeps the even share (where the operator starts); with
`split="demand"` the operator's own poll round (`kvquota.split.demand.PoolSplit`) runs
every `rebalance_interval` virtual seconds (the operator's poll interval) on each
engine's sidecar status (`build_status`, the sidecar's code), and the policy it renders
(the even entries plus `engine_overrides`) reaches every engine the way a ConfigMap
does: the plugin's policy file is replaced (the plugin polls it) and the sidecar takes
it, each enforcing `EnginePolicy.for_engine(its pod name)`, as in a pod.

The engines advance in time order: the next thing to happen is an arrival, a
rebalance, or the step of the engine whose clock is furthest behind (kept in a heap by
`_EngineClock`, so a step costs log N, not N); an idle engine's clock jumps to its next
arrival. Nothing reads the wall clock except to report the
run's cost (the report divides it by the `engineHours` simulated).

The router reads each engine as a real endpoint picker does (`PoolSpec.signals`):
vLLM's own waiting count and KV usage (the sidecar's queue unseen), or KVQuota's
per-tier series for the routed request's tier, computed by the sidecar's own code
(`picker_signals.tier_signals`) from the engine's policy, plugin stats, queue and
pool view. Stock engines have no sidecar: their picker reads vLLM's series either way.
"""

from __future__ import annotations

import heapq
import math
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy, Isolation, PoolLimits, Tier
from engine_sidecar.contract.stats import SidecarStatus
from engine_sidecar.gateway.admission.call_back import calls_back
from engine_sidecar.gateway.admission.rules import Decision
from engine_sidecar.gateway.auth.callers import Authenticator
from engine_sidecar.gateway.policy.active import ActivePolicy
from engine_sidecar.gateway.pool.admission import PoolAdmission
from engine_sidecar.gateway.telemetry.picker_signals import (
    KV_USAGE,
    TIER_LABEL,
    WAITING,
    tier_signals,
)
from engine_sidecar.gateway.telemetry.status import DecisionCounters, build_status
from kvquota.runtime import OperatorConfig
from kvquota.split.demand import PoolSplit, SplitInputs, engine_overrides
from kvquota.split.rebalance import TenantTotals
from kvquota_lab.bench.metrics import Outcome, RunResult, Timeline
from kvquota_lab.bench.picker_config import PickerConfig, load_picker_config
from kvquota_lab.bench.policies import BASELINE, PolicySpec
from kvquota_lab.bench.pool_ceilings import SAMPLE_S, PoolCeilings
from kvquota_lab.bench.pool_ledger import TwinLedger, TwinPoolStore
from kvquota_lab.bench.router_choice import make_router
from kvquota_lab.bench.routers import (
    KVQUOTA_SIGNALS,
    SIGNALS,
    VLLM_SIGNALS,
    EngineLoad,
    Router,
    RouteRequest,
    SeriesKey,
)
from kvquota_lab.bench.scenario import Bursts, Scenario, Session, generate_sessions
from kvquota_lab.bench.twin import (
    KV_REFUSALS,
    TIMELINE_SAMPLES,
    Progress,
    TwinEvent,
    TwinRun,
    plugin_extra,
)

if TYPE_CHECKING:
    from engine_sidecar.gateway.admission.queue import Ticket
    from kvquota_lab.bench.cost import CostProfile
    from kvquota_lab.bench.tasks import TwinTask
    from kvquota_lab.twin.harness import SchedulerHarness

SPLITS = ("even", "demand")
VLLM_WAITING, VLLM_RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
INF = math.inf


@dataclass(frozen=True)
class PoolSpec:
    replicas: int
    router: str
    split: str = "even"
    rebalance_interval: float = OperatorConfig.poll_interval
    signals: str = VLLM_SIGNALS  # what the picker reads (`routers.SIGNALS`)
    kv_filter: float | None = None  # prefix-affinity: leave out engines whose KV reads >= it
    # prefix-affinity on KVQuota's signals: the picker configuration it runs (None: the
    # shipped one, `picker_config.SHIPPED_CONFIG`).
    picker_config: Path | None = None
    # The pool-wide ledger on a shared store (`spec.poolStore`), modelled in memory
    # with a round-trip cost (`pool_ledger`).
    ledger: bool = True

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.split not in SPLITS:
            raise ValueError(f"unknown split {self.split!r}; choose from {', '.join(SPLITS)}")
        if self.signals not in SIGNALS:
            raise ValueError(f"unknown picker signals {self.signals!r}; choose from "
                             f"{', '.join(SIGNALS)}")
        if self.rebalance_interval <= 0:
            raise ValueError("the rebalance interval must be > 0 seconds")
        if self.kv_filter is not None and not 0 < self.kv_filter <= 1:
            raise ValueError(f"--picker-kv-filter must be in (0, 1], got {self.kv_filter}")
        if self.kv_filter is not None and self.router != "prefix-affinity":
            raise ValueError("--picker-kv-filter is modelled for --router prefix-affinity only")


def scale_load(scenario: Scenario, replicas: int) -> Scenario:
    """The scenario with every workload's arrivals x `replicas` (rates, burst sizes);
    the engine, the per-engine quotas and everything else unchanged."""
    if replicas == 1:
        return scenario
    tenants = {}
    for tenant_id, tenant in scenario.tenants.items():
        workloads = {}
        for name, workload in tenant.workloads.items():
            arrival = workload.arrival
            if isinstance(arrival, Bursts):
                arrival = arrival.model_copy(update={"size": arrival.size * replicas})
            else:
                arrival = arrival.model_copy(update={"rate": arrival.rate * replicas})
            workloads[name] = workload.model_copy(update={"arrival": arrival})
        tenants[tenant_id] = tenant.model_copy(update={"workloads": workloads})
    return scenario.model_copy(update={"tenants": tenants})


class _Engine(TwinRun):
    """One engine of the pool: TwinRun's per-engine half; events, conversations and
    outcomes are the pool's."""

    def __init__(self, pool: PoolRun, index: int, tmp: Path) -> None:
        super().__init__(pool.scenario, [], pool.spec, pool.profile)
        self.pool = pool
        self.index = index
        self.name = f"engine-{index}"
        self.engine_name = self.name
        self.policy = pool.policy
        self.outcomes = pool.outcomes
        self._contexts = pool.contexts
        self._prompts = pool.prompts
        tmp.mkdir(parents=True, exist_ok=True)
        self.policy_path = tmp / "policy.json"
        self.harness = self._harness(tmp)
        self.blocked = False  # the last step could schedule nothing: wait for news
        self.steps = 0
        self.counters = DecisionCounters()  # the sidecar's, for its status
        self._auth = Authenticator.from_policy(self.policy.auth, None, self.policy.tenants)
        self.routed = 0

    def _push(self, at: float, session: Session, turn: int, outcome: Outcome | None = None
              ) -> None:
        self.pool.push(at, session, turn, outcome)

    def _settle(self) -> None:
        self.pool.settled += 1

    def _settle_ticket(self, harness: SchedulerHarness, ticket: Ticket) -> None:
        tenant = ticket.payload.session.tenant
        if ticket.reservation is not None:
            self.counters.count(tenant, Decision.ADMITTED)
            self.pool.admitted(ticket, self)
            self.pool.count_above_max(tenant)
        elif ticket.error is not None and ticket.verdict is not None:
            self.counters.count(tenant, ticket.verdict.decision)
        self.pool.count_refusal(ticket)
        super()._settle_ticket(harness, ticket)

    # -- what the router and the operator see ---------------------------------------

    def charged(self, tenant: str) -> int:
        """What this engine's admission charges `tenant` (`_TenantView.charged`): its
        ledger's count, or the blocks its running requests hold where more, from the
        plugin's stats as the sidecar last read them (not refreshed: measuring must not
        move what the sidecar sees). Not running plus the joint bound, which admission
        stopped charging: that counted the same tokens twice (8 engines, small, seed 31:
        scraper 27 blocks "over" its pool-wide maxBlocks while the store's claims summed
        4,776 of its 4,800)."""
        if self.gateway is None:
            return 0
        seen = self._stats.tenants.get(tenant) if self._stats is not None else None
        running = seen.running_blocks if seen is not None else 0
        return max(self.gateway.ledger.reserved_blocks(tenant), running)

    def held(self) -> Counter[str]:
        """Blocks each tenant holds here: its running requests' (vLLM's block tables)
        and its leases, from the plugin's stats as the sidecar last read them."""
        manager = self.harness.scheduler.kv_cache_manager
        held: Counter[str] = Counter()
        for request in self.harness.scheduler.running:
            live = self._live.get(request.request_id)
            if live is not None:
                held[live.session.tenant] += len(manager.get_block_ids(request.request_id)[0])
        if self._stats is not None:
            for tenant_id, stats in self._stats.tenants.items():
                held[tenant_id] += stats.leased_blocks
        return held

    def load(self, tier: Tier, signals: str) -> EngineLoad:
        """What the picker routing a request of `tier` scrapes from this engine now:
        vLLM's series (vLLM's own accessors: its waiting queue, not the sidecar's), or,
        with KVQuota's signals and a sidecar in front, that tier's series as the
        sidecar serves them (its `tier_signals`, on its policy, stats, queue, view)."""
        scheduler = self.harness.scheduler
        running, waiting = scheduler.get_request_counts()
        kv_usage = float(scheduler.get_kv_cache_usage())
        series: dict[SeriesKey, float] = {
            (VLLM_WAITING, ()): waiting, (VLLM_RUNNING, ()): running,
            (VLLM_KV_USAGE, ()): kv_usage}
        gateway = self.gateway
        if signals == KVQUOTA_SIGNALS and gateway is not None:
            queue = gateway.queue
            for signal in tier_signals(queue.policy, self._engine_stats(self.harness), queue,
                                       queue.view()):
                labels = ((TIER_LABEL, signal.tier),)
                series[(WAITING, labels)] = signal.waiting
                if signal.kv_usage is not None:
                    series[(KV_USAGE, labels)] = signal.kv_usage
                if signal.tier == tier.value:
                    waiting = signal.waiting
                    if signal.kv_usage is not None:
                        kv_usage = signal.kv_usage
        return EngineLoad(kv_usage=kv_usage, waiting=waiting, running=running, series=series)

    def status(self) -> SidecarStatus:
        """What the engine's sidecar serves at `/kvquota/status` now (`build_status`,
        the sidecar's own code, from its ledger, queue, counters and the plugin's
        stats as the sidecar last read them): what the operator's poll reads."""
        gateway = self.gateway
        assert gateway is not None
        queue = gateway.queue
        active = ActivePolicy(policy=self.policy.for_engine(self.name), auth=self._auth,
                              cache_salts={})
        return build_status(
            ready=True, active=active, policy_error=None, ledger=gateway.ledger,
            counters=self.counters, stats=self._engine_stats(self.harness),
            capacity=queue.view(), queue=queue,
        )

    def apply_policy(self, policy: EnginePolicy) -> bool:
        """The pool's new policy reaches the engine as in a pod: the plugin's policy
        file is replaced (it polls the file and enforces `for_engine(name)`), and the
        sidecar enforces the same. True when this engine's own blocks changed."""
        view = policy.for_engine(self.name)
        changed = view.tenants != self.policy.for_engine(self.name).tenants
        self.policy = policy
        write_atomically(self.policy_path, policy.to_json())
        if self.gateway is not None:
            self.gateway.set_policy(view)
        return changed

    # -- time -----------------------------------------------------------------------

    def next_time(self, news: float) -> float:
        """When this engine next has something to do (`news`: the pool's next arrival
        or rebalance, which may unblock it)."""
        harness = self.harness
        wakeup = self.gateway.next_wakeup() if self.gateway is not None else None
        if harness.has_unfinished():
            if not self.blocked:
                return harness.now
            return max(harness.now, min(news, wakeup if wakeup is not None else INF))
        if wakeup is not None:
            return max(harness.now, wakeup)
        return INF

    def catch_up(self, at: float) -> None:
        if self.harness.now < at:
            self.harness.advance(at - self.harness.now)

    def turn(self) -> None:
        """What the single-engine twin does in one pass of its loop."""
        harness = self.harness
        if self.gateway is not None:
            for ticket in self.gateway.poll():
                self._settle_ticket(harness, ticket)
        self.blocked = False
        if not harness.has_unfinished():
            return
        record = harness.step()
        self.steps += 1
        for req_id in record.finished_req_ids:
            if req_id in self._live:
                self._finish(harness, req_id)
        if not record.num_scheduled_tokens and not harness.scheduler.running:
            self.blocked = True
        if len(harness.steps) > 4096:
            del harness.steps[:-1]


class _EngineClock:
    """Which engine runs next: the one with the earliest `next_time` (the lowest index
    on a tie), without asking every engine at every step. An engine's next time changes
    only when something happens to it (a step, a routed turn, a new split: the caller
    says so with `moved`), so engines wait in a heap keyed on it; only a blocked engine
    with work (its next time is the pool's next news) is asked each time."""

    def __init__(self, engines: list[_Engine]) -> None:
        self._engines = engines
        self._heap: list[tuple[float, int, int]] = []  # (next time, index, stamp)
        self._stamps = [0] * len(engines)
        self._on_news: set[int] = set()
        for engine in engines:
            self.moved(engine)

    def moved(self, engine: _Engine) -> None:
        index = engine.index
        self._stamps[index] += 1
        if engine.blocked and engine.harness.has_unfinished():
            self._on_news.add(index)
            return
        self._on_news.discard(index)
        at = engine.next_time(INF)  # not blocked: its time does not depend on news
        if at < INF:
            heapq.heappush(self._heap, (at, index, self._stamps[index]))

    def next(self, news: float) -> tuple[float, _Engine | None]:
        heap = self._heap
        while heap and heap[0][2] != self._stamps[heap[0][1]]:
            heapq.heappop(heap)  # an engine's older entry
        best = (heap[0][0], heap[0][1]) if heap else (INF, -1)
        for index in self._on_news:
            best = min(best, (self._engines[index].next_time(news), index))
        return best[0], (self._engines[best[1]] if best[1] >= 0 else None)


class PoolRun:
    """One policy over one scenario on a pool. `run()` returns what it measured."""

    def __init__(
        self, scenario: Scenario, spec: PolicySpec, pool: PoolSpec, profile: CostProfile,
        *, progress: Progress | None = None,
    ) -> None:
        self.scenario = scenario  # its load already scaled to the pool (`scale_load`)
        self.sessions = generate_sessions(self.scenario)
        self.spec = spec
        self.pool = pool
        self.profile = profile
        self.progress = progress
        self.outcomes: list[Outcome] = []
        self.contexts: dict[str, list[int]] = {}
        self.prompts: dict[tuple[str, int], list[int]] = {}
        self.settled = 0
        self.events: list[TwinEvent] = []
        self._seq = 0
        engine = self.scenario.engine
        self.picker_config = self._picker_config()
        self.router: Router = make_router(
            pool.router, pool.replicas, block_size=engine.block_size,
            capacity_blocks=engine.capacity_blocks, model="bench", kv_filter=pool.kv_filter,
            config=self.picker_config,
        )
        policy = self.scenario.engine_policy().model_copy(update={"replicas": pool.replicas})
        self.ledger = TwinLedger() if pool.ledger and spec.admission else None
        if self.ledger is not None:
            policy = policy.model_copy(update={"tenants": {
                tid: t.model_copy(update={"pool_wide": PoolLimits(
                    guaranteed_blocks=t.guaranteed_blocks * pool.replicas,
                    max_blocks=t.max_blocks_per_engine * pool.replicas,
                    max_concurrent_requests=(t.max_concurrent_requests * pool.replicas
                                             if t.max_concurrent_requests else None))})
                for tid, t in policy.tenants.items()}})
        policy = policy.with_version()
        self.policy = policy  # the pool's: the even split and the per-engine overrides
        self.salts = {
            tid: None if t.prefix_cache_isolation is Isolation.SHARED else tid
            for tid, t in policy.tenants.items()
        }
        self.totals = [
            TenantTotals(tid, t.guaranteed_blocks * pool.replicas,
                         t.max_blocks_per_engine * pool.replicas, t.priority)
            for tid, t in sorted(policy.tenants.items())
        ]
        self.pool_guarantee = {t.tenant_id: t.guaranteed for t in self.totals}
        self.pool_maximum = {t.tenant_id: t.maximum for t in self.totals}
        # Where each tenant's own pool-wide maxBlocks held it back (`pool_ceilings`).
        self.ceilings = PoolCeilings(self.scenario.duration, {
            tid: (self.scenario.tier_of(tid).value, self.pool_maximum[tid])
            for tid in self.scenario.tenants if tid in self.pool_maximum})
        # Tenant -> the most its engines' charges, work admitted into idle KV beyond
        # maxBlocks left out, summed over the pool, passed its pool-wide maxBlocks by.
        self.above_pool_max: Counter[str] = Counter()
        self.split_inputs = SplitInputs(self.totals, engine.capacity_blocks, policy.watermark)
        self.split = PoolSplit()  # the operator's state for the pool
        self.refused_within_pool: Counter[str] = Counter()  # by tier
        # Session -> the engine its session token names (`admitted`, `deliver`).
        self.token_engines: dict[str, int] = {}
        self.rebalances = 0
        self.policy_versions = 0  # policies the operator wrote
        self.policy_updates = 0  # engines whose own blocks changed, over all versions
        self.engines: list[_Engine] = []

    def _picker_config(self) -> PickerConfig | None:
        """The configuration a `prefix-affinity` picker reading KVQuota's series runs,
        checked to have a profile for every tier the scenario's clients send."""
        if not (self.pool.router == "prefix-affinity" and self.spec.admission
                and self.pool.signals == KVQUOTA_SIGNALS):
            return None
        config = load_picker_config(self.pool.picker_config)
        for tier in self.scenario.tiers:
            config.profile_for(tier.value)
        return config

    # -- bookkeeping the engines call -------------------------------------------------

    def push(self, at: float, session: Session, turn: int, outcome: Outcome | None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, session, turn, outcome))

    def admitted(self, ticket: Ticket, engine: _Engine) -> None:
        """The sidecar's response names its engine in the session token when the
        session's tenant has leases, and clears the token instead when the tenant's
        charge there leaves less than the next turns of the sessions it already called
        back and another of this one below its ceiling (`gateway.admission.call_back.calls_back`,
        on the engine's own policy and admission view, as the sidecar's relay decides
        it); its client echoes the token with the session's next turns, retries
        included. Behind a configured picker the picker's own scorer writes the token
        instead (`deliver`)."""
        if self.picker_config is not None:
            return
        tenant = self.policy.tenants.get(ticket.tenant_id)
        session = ticket.shape.session
        if not session or tenant is None or tenant.lease.seconds <= 0:
            return
        gateway, reservation = engine.gateway, ticket.reservation
        if gateway is None or reservation is None:
            return
        enforced = gateway.queue.policy  # the engine's own (`for_engine`)
        assert enforced is not None
        own = enforced.tenants[ticket.tenant_id]
        if calls_back(gateway.queue.view(), ticket.tenant_id, session, reservation.turn_blocks,
                      own.max_blocks_per_engine):
            self.token_engines[session] = engine.index
        else:
            self.token_engines.pop(session, None)

    def count_above_max(self, tenant: str) -> None:
        """After an admission: how far the tenant's charges over the pool pass its
        pool-wide maxBlocks, its above-max work (the plugin's first victim) left out.
        The ledger keeps one growth bound for all of a tenant's requests, so on an
        engine where some were admitted beyond maxBlocks the bound is left out too:
        there the count is a lower bound (counting it all put the free tier of
        noisy-neighbour, small, 8 engines, seed 31, 484 blocks over; without, 0)."""
        held = 0
        for engine in self.engines:
            if engine.gateway is not None:
                ledger = engine.gateway.ledger
                beyond = ledger.beyond_max_blocks(tenant)
                held += engine.charged(tenant) - beyond - (
                    ledger.growth(tenant).bound if beyond > 0 else 0)
        over = held - self.pool_maximum.get(tenant, held)
        if over > self.above_pool_max[tenant]:
            self.above_pool_max[tenant] = over

    def count_refusal(self, ticket: Ticket) -> None:
        verdict = ticket.verdict
        if ticket.reservation is not None or ticket.error is None or verdict is None:
            return
        if verdict.decision not in KV_REFUSALS:
            return
        tenant = ticket.payload.session.tenant
        held = sum(e.charged(tenant) for e in self.engines)
        if verdict.decision is Decision.REJECTED_QUOTA:
            self.ceilings.refused(tenant, held, verdict.blocks)
        if held + verdict.blocks <= self.pool_guarantee.get(tenant, 0):
            self.refused_within_pool[ticket.payload.session.tier.value] += 1

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> RunResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        with tempfile.TemporaryDirectory(prefix="kvquota-pool-") as tmp:
            try:
                self.open(Path(tmp))
                result = self._loop()
            finally:
                self.close()
        result.wall_seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu_started
        engine_hours = result.makespan * self.pool.replicas / 3600
        result.extra["pool"]["engineHours"] = round(engine_hours, 4)

        return result

    def open(self, tmp: Path) -> None:
        """The pool's engines, their files under `tmp` (`run` does this; `close` after)."""
        self.engines = [_Engine(self, i, tmp / f"engine-{i}")
                        for i in range(self.pool.replicas)]
        if self.ledger is not None:
            for engine in self.engines:
                assert engine.gateway is not None
                engine.gateway.queue.pool = PoolAdmission(TwinPoolStore(self.ledger, engine.name))
            self._refresh_ledger()

    def _refresh_ledger(self) -> None:
        """Every sidecar republishes its claims (3x per TTL on a real store)."""
        for engine in self.engines:
            queue = engine.gateway.queue if engine.gateway is not None else None
            if queue is not None and queue.pool is not None and queue.policy is not None:
                queue.pool.refresh(queue.policy, queue.view())

    def close(self) -> None:
        for engine in self.engines:
            engine.harness.shutdown()

    def pick(self, event: TwinEvent) -> _Engine:
        """The engine the router sends this turn to, from what its picker sees now."""
        _, _, session, turn, _ = event
        key = (session.session_id, turn)
        prompt = self.prompts.get(key)
        if prompt is None:
            prompt = (session.first_prompt() if turn == 0
                      else self.contexts[session.session_id] + session.new_tokens(turn))
            self.prompts[key] = prompt  # `_arrive` takes it from here
        # The session-affinity scorer is part of the picker configuration that reads
        # KVQuota's series (`routers`): with vLLM's, the token goes unread.
        token = (self.token_engines.get(session.session_id)
                 if self.pool.signals == KVQUOTA_SIGNALS else None)
        request = RouteRequest(session.tenant, session.session_id, prompt,
                               self.salts.get(session.tenant), token, session.tier.value)
        loads = [e.load(session.tier, self.pool.signals) for e in self.engines]
        return self.engines[self.router.pick(request, loads)]

    def deliver(self, engine: _Engine, event: TwinEvent) -> None:
        """The turn arrives at `engine`'s sidecar (admitted, queued or refused there)."""
        engine.routed += 1
        if self.picker_config is not None:
            # The session-affinity scorer writes the pod it picked on the response (over
            # the sidecar's token, whatever the outcome); the client echoes it.
            self.token_engines[event[2].session_id] = engine.index
        engine.catch_up(event[0])
        engine.blocked = False
        engine._arrive(engine.harness, event)

    def _route(self, event: TwinEvent) -> _Engine:
        engine = self.pick(event)
        self.deliver(engine, event)
        return engine

    def _rebalance(self) -> list[_Engine]:
        """One operator poll round (`demand_split.PoolSplit`, on every engine's sidecar
        status) and the policy it renders (`engine_overrides`: the per-engine entries);
        returns the engines whose own blocks changed. A new policy version reaches
        every engine, as a ConfigMap does."""
        names = [e.name for e in self.engines]
        self.split.poll_round(self.split_inputs, names,
                              {e.name: e.status() for e in self.engines})
        self.rebalances += 1
        overrides = engine_overrides(self.policy.tenants, self.split.splits,
                                     self.pool.replicas)
        policy = EnginePolicy.model_validate(self.policy.model_copy(
            update={"engines": overrides, "version": ""}).model_dump()).with_version()
        if policy.version == self.policy.version:
            return []
        self.policy = policy
        self.policy_versions += 1
        changed = [engine for engine in self.engines if engine.apply_policy(policy)]
        self.policy_updates += len(changed)
        if changed and self.ledger is not None:
            # A sidecar republishes on a new policy: the engines whose share fell give
            # it back (first pass), then those whose share rose may claim it (second).
            self._refresh_ledger()
            self._refresh_ledger()
        return changed

    def _loop(self) -> RunResult:
        for session in self.sessions:
            self.push(session.start, session, 0, None)
        scenario = self.scenario
        deadline = scenario.duration + scenario.drain_timeout
        interval = scenario.duration / TIMELINE_SAMPLES
        timeline = Timeline(capacity=scenario.engine.capacity_blocks * self.pool.replicas)
        next_sample = next_ceilings = 0.0
        demand_split = self.pool.split == "demand" and self.spec.admission
        next_rebalance = self.pool.rebalance_interval if demand_split else INF
        refresh_interval = TwinPoolStore.ttl_s / 3
        next_refresh = refresh_interval if self.ledger is not None else INF
        planned = sum(len(s.turns) for s in self.sessions)
        notes: list[str] = []
        last_report = -1.0
        now = 0.0
        clock = _EngineClock(self.engines)
        while True:
            t_event = self.events[0][0] if self.events else INF
            news = min(t_event, next_rebalance, next_refresh)
            t_engine, engine = clock.next(news)
            if t_event == INF and t_engine == INF:
                break
            t = min(t_event, t_engine, next_rebalance, next_refresh)
            if t > deadline:
                unfinished = sum(len(e._live) for e in self.engines)
                notes.append(f"stopped at {deadline:.0f} s (duration + drainTimeout) with "
                             f"{unfinished} requests unfinished")
                break
            now = max(now, t)
            if self.ledger is not None:
                self.ledger.now = now
            if t_event <= t:
                clock.moved(self._route(heapq.heappop(self.events)))
            elif next_refresh <= t:
                self._refresh_ledger()
                for each in self.engines:
                    clock.moved(each)
                next_refresh = t + refresh_interval
            elif next_rebalance <= t:
                for changed in self._rebalance():
                    clock.moved(changed)
                next_rebalance = t + self.pool.rebalance_interval
            else:
                assert engine is not None
                engine.catch_up(t)
                engine.turn()
                clock.moved(engine)
            if now >= next_sample:
                self._sample(timeline, now)
                next_sample = now + interval
            if now >= next_ceilings:
                self._sample_ceilings(now)
                next_ceilings = now + SAMPLE_S
            if self.progress is not None and now - last_report >= 1.0:
                last_report = now
                self.progress(self.key, self.settled, planned, now)
        self._sample(timeline, now)
        for engine in self.engines:
            if engine.blocked and engine._live:
                notes.append(f"{engine.name} stalled at {engine.harness.now:.0f} s: "
                             f"{len(engine._live)} requests could not be scheduled")
        if self.progress is not None:
            self.progress(self.key, planned, planned, now)
        return self._result(timeline, notes)

    @property
    def key(self) -> str:
        if not self.spec.admission:
            return self.spec.key
        signals = ":signals" if self.pool.signals == KVQUOTA_SIGNALS else ""
        return f"{self.spec.key}:{self.pool.split}{signals}"

    def _sample(self, timeline: Timeline, now: float) -> None:
        total: Counter[str] = Counter()
        for engine in self.engines:
            total.update(engine._kv_by_tier(engine.harness))
        timeline.add(round(now, 6), dict(total))

    def _sample_ceilings(self, now: float) -> None:
        held: Counter[str] = Counter()
        charged: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        for engine in self.engines:
            held.update(engine.held())
            queue = engine.gateway.queue if engine.gateway is not None else None
            if queue is not None:
                for tenant_id in self.pool_maximum:
                    charged[tenant_id] += engine.charged(tenant_id)
                    queued[tenant_id] += queue.depth(tenant_id)
        self.ceilings.sample(now, held, charged if self.spec.admission else held, queued)

    def _result(self, timeline: Timeline, notes: list[str]) -> RunResult:
        makespan = max((o.finish for o in self.outcomes if o.finish is not None), default=0.0)
        label = self.spec.label
        if self.spec.admission:
            label += f", {self.pool.split} split"
            if self.pool.signals == KVQUOTA_SIGNALS:
                label += ", KVQuota signals"
        if self.picker_config is not None:
            label += f", picker {Path(self.picker_config.source).name}"
        if self.pool.kv_filter is not None:
            label += f", KV filter {self.pool.kv_filter:g}"
        result = RunResult(
            key=self.key, label=label, outcomes=self.outcomes, timeline=timeline,
            makespan=makespan, steps=sum(e.steps for e in self.engines), notes=notes,
        )
        extra: dict[str, Any] = {}
        if self.spec.admission:
            waits: dict[str, float] = {}
            for engine in self.engines:
                if engine.gateway is not None:
                    for tenant_id, seconds in engine.gateway.queue.idle_waits.items():
                        if tenant_id in self.scenario.tenants:
                            tier = self.scenario.tier_of(tenant_id).value
                            waits[tier] = waits.get(tier, 0.0) + seconds
            result.beside_idle_kv = waits
        if self.engines and self.engines[0].harness.plugin is not None:
            result.has_leases = True
            for engine in self.engines:
                stats = engine.harness.kvq_stats()
                _merge_counts(extra, plugin_extra(stats))
                for tenant_id, tenant_stats in stats.tenants.items():
                    if tenant_id in self.scenario.tenants:
                        tier = self.scenario.tier_of(tenant_id).value
                        result.lease_breaks[tier] = (
                            result.lease_breaks.get(tier, 0) + tenant_stats.lease_breaks
                        )
        extra["pool"] = {
            "replicas": self.pool.replicas,
            "router": self.pool.router,
            "split": self.pool.split if self.spec.admission else None,
            "signals": self.pool.signals if self.spec.admission else VLLM_SIGNALS,
            "pickerConfig": self.picker_config.source if self.picker_config else None,
            "refusedWithinPoolGuarantee": {
                tier.value: self.refused_within_pool.get(tier.value, 0)
                for tier in self.scenario.tiers
            },
            "aboveMaxBlocks": {tid: self.above_pool_max.get(tid, 0)
                               for tid in sorted(self.pool_maximum)},
            "ownMaxBlocks": self.ceilings.to_json(),
            "requestsPerEngine": [e.routed for e in self.engines],
            "rebalances": self.rebalances,
            "policyVersions": self.policy_versions,
            "policyUpdates": self.policy_updates,
            "finalSplit": {
                tid: [self.policy.blocks_on(e.name, tid)[0] for e in self.engines]
                for tid in sorted(self.policy.tenants)
            } if self.policy.engines else {},
        }
        if self.ledger is not None:
            extra["pool"]["ledger"] = self._ledger_report()
        result.extra = extra
        return result

    def _ledger_report(self) -> dict[str, Any]:
        """The share of admissions that needed the store, and what its round trip adds
        at the p99 of admissions (one round trip when more than 1% needed it)."""
        assert self.ledger is not None
        outcomes: Counter[str] = Counter()
        within = 0  # admitted into a watermark's room on the pool-wide guarantee
        for engine in self.engines:
            queue = engine.gateway.queue if engine.gateway is not None else None
            if queue is not None and queue.pool is not None:
                outcomes.update({o.value: n for o, n in queue.pool.charges.items()})
                within += queue.pool.within_guarantee
        admitted = outcomes["local"] + outcomes["pool"]
        needed = outcomes["pool"] + outcomes["refused"]
        decisions = max(1, admitted + outcomes["refused"])
        share = needed / decisions
        # A take-back costs the charge, the others' lean and the retry: three round trips.
        trips = 3 if self.ledger.take_backs / decisions > 0.01 else 1
        return {
            "admittedLocally": outcomes["local"], "admittedByStore": outcomes["pool"],
            "refusedByStore": outcomes["refused"], "roundTrips": self.ledger.round_trips,
            "takeBacks": self.ledger.take_backs, "withinGuarantee": within,
            "storeShare": round(share, 4),
            "p99AddedSeconds": trips * self.ledger.rtt_s if share > 0.01 else 0.0,
        }


def _merge_counts(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Sum nested counters (the plugin's per-engine extras) into one pool's."""
    for key, value in more.items():
        if isinstance(value, dict):
            _merge_counts(into.setdefault(key, {}), value)
        else:
            into[key] = round(into.get(key, 0) + value, 1)


def run_pool(
    scenario: Scenario, spec: PolicySpec, pool: PoolSpec, profile: CostProfile,
    progress: Progress | None = None,
) -> RunResult:
    return PoolRun(scenario, spec, pool, profile, progress=progress).run()


def pool_tasks(
    scenario: Scenario, specs: list[PolicySpec], baseline: Scenario | None, *,
    replicas: int, router: str, splits: tuple[str, ...],
    signals: tuple[str, ...] = (KVQUOTA_SIGNALS,), kv_filter: float | None = None,
    picker_config: Path | None = None, ledger: bool = True,
) -> list[TwinTask]:
    """The runs of a pool bench: every policy (those with admission once per split and
    picker signals; without a sidecar a picker reads vLLM's series), then the baseline
    if any; `scenario` and `baseline` already scaled."""
    unknown = [s for s in splits if s not in SPLITS]
    if unknown or not splits:
        raise ValueError(f"unknown splits {unknown}; choose from {', '.join(SPLITS)}")
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown or not signals:
        raise ValueError(f"unknown picker signals {unknown}; choose from {', '.join(SIGNALS)}")
    tasks: list[TwinTask] = []
    for spec in specs:
        if not spec.admission:
            tasks.append((scenario, spec, PoolSpec(replicas, router, kv_filter=kv_filter)))
            continue
        for split in splits:
            for signal in signals:
                tasks.append((scenario, spec, PoolSpec(replicas, router, split,
                                                       signals=signal, kv_filter=kv_filter,
                                                       picker_config=picker_config,
                                                       ledger=ledger)))
    if baseline is not None:
        tasks.append((baseline, BASELINE, PoolSpec(replicas, router, kv_filter=kv_filter)))
    return tasks
