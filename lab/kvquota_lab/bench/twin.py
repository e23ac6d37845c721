"""The `twin` backend: a scenario through vLLM's real scheduler on virtual time.

Each policy runs on a fresh `kvquota_lab.twin.harness.SchedulerHarness` (vLLM's own
`Scheduler` and KV cache manager, no model): stock FCFS, stock priority with the
tiers' priorities, and KVQuota, the plugin (`TenantAwareScheduler`, fed the
`EnginePolicy` the operator would render for the scenario's tenants) behind the
sidecar's admission (`bench.admission`). Steps take the time the cost profile says;
a request arrives when virtual time passes its arrival; the next turn of a session
arrives its think time after the previous answer finished; a refused request is
retried after Retry-After, up to the scenario's `clients.maxAttempts`.

Nothing here reads the wall clock except to report how long the run took, so the same
scenario and seed give the same numbers.
"""

from __future__ import annotations

import heapq
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.gateway.admission.rules import Decision
from engine_sidecar.plugin.stats_publisher import STEP_INTERVAL_S
from kvquota_lab.bench.admission import TwinGateway
from kvquota_lab.bench.charges import ChargeLog
from kvquota_lab.bench.cost import CostProfile
from kvquota_lab.bench.metrics import Outcome, RunResult, Timeline
from kvquota_lab.bench.occupancy import Occupancy
from kvquota_lab.bench.plugin_counts import above_max_by_tier, outgrown_by_tier
from kvquota_lab.bench.policies import PolicySpec
from kvquota_lab.bench.scenario import Scenario, Session
from kvquota_lab.bench.ttft_parts import TtftLedger
from kvquota_lab.bench.variants import victim_ranker

if TYPE_CHECKING:
    from engine_sidecar.contract.stats import EngineStats
    from engine_sidecar.gateway.admission.ledger import Reservation
    from engine_sidecar.gateway.admission.queue import Ticket
    from kvquota_lab.twin.harness import SchedulerHarness, TwinRequest

# Progress callback: (policy key, requests settled, requests planned, virtual seconds).
Progress = Callable[[str, int, int, float], None]
# Refusals for KV blocks (quota, watermark); concurrency is a limit of its own.
KV_REFUSALS = frozenset({Decision.REJECTED_QUOTA, Decision.REJECTED_WATERMARK})
TIMELINE_SAMPLES = 200


def twin_model_dir(max_model_len: int) -> Path:
    """A config-only copy of the tiny model (the harness reads nothing else), with room
    for the scenario's context length."""
    from kvquota_lab.tinymodel import GENERATOR_VERSION, MODEL_CONFIG

    positions = max(int(MODEL_CONFIG["max_position_embeddings"]), max_model_len)
    out = Path(tempfile.gettempdir()) / f"kvquota-twin-model-v{GENERATOR_VERSION}-{positions}"
    config = json.dumps({**MODEL_CONFIG, "max_position_embeddings": positions}, indent=2)
    target = out / "config.json"
    if not target.is_file() or target.read_text() != config:
        write_atomically(target, config)
    return out


# (time, sequence number, session, 0-based turn, the outcome of an earlier attempt);
# the sequence number breaks ties, so sessions are never compared.
TwinEvent = tuple[float, int, Session, int, Outcome | None]


@dataclass
class _Attempt:
    """A turn on its way to the engine (the payload of its admission ticket)."""

    session: Session
    turn: int
    outcome: Outcome
    prompt: list[int]
    requested_max_tokens: int | None
    at: float = 0.0  # when the client sent this attempt


@dataclass
class _Live:
    outcome: Outcome
    session: Session
    turn: int
    prompt: list[int]
    reservation: Reservation | None


class TwinRun:
    """One policy over one scenario. `run()` returns what it measured."""

    def __init__(
        self,
        scenario: Scenario,
        sessions: list[Session],
        spec: PolicySpec,
        profile: CostProfile,
        *,
        progress: Progress | None = None,
        work_dir: Path | None = None,
    ) -> None:
        self.scenario = scenario
        self.sessions = sessions
        self.spec = spec
        self.profile = profile
        self.progress = progress
        self.work_dir = work_dir
        # The policy file's content; the engine enforces `policy.for_engine(engine_name)`.
        self.policy: EnginePolicy = scenario.engine_policy()
        self.engine_name: str | None = None  # its pod name (one engine: unnamed)
        self.gateway: TwinGateway | None = None
        self._harness_now: Callable[[], float] = lambda: 0.0
        self.outcomes: list[Outcome] = []
        self.timeline = Timeline(capacity=scenario.engine.capacity_blocks)
        self.occupancy = Occupancy.for_scenario(scenario)
        # What each tenant held and had in flight since `_tenants_at` (KVQuota runs).
        self._tenants_at = 0.0
        self._held: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._events: list[TwinEvent] = []
        self._seq = 0
        self._live: dict[str, _Live] = {}
        self._contexts: dict[str, list[int]] = {}  # session -> tokens so far
        self._prompts: dict[tuple[str, int], list[int]] = {}  # prompts of retries
        self._tier_of_req: dict[str, str] = {}
        self._stats: EngineStats | None = None
        # What admission charged each tenant beside what it held, per stats reading.
        self.charges = ChargeLog(scenario.duration)
        self._charged_at: EngineStats | None = None
        self._stats_until = 0.0
        self._planned = sum(len(s.turns) for s in sessions)
        self._settled = 0
        # Where each turn's TTFT goes; set by this class's own loop (a pool's engines
        # step in theirs and leave it unset).
        self._ttft: TtftLedger | None = None

    # -- setup --------------------------------------------------------------------

    def _harness(self, tmp: Path) -> SchedulerHarness:
        from kvquota_lab.twin.harness import SchedulerHarness, TwinConfig

        engine = self.scenario.engine
        policy_path = None
        if self.spec.scheduler == "kvquota":
            policy_path = tmp / "policy.json"
            write_atomically(policy_path, self.policy.to_json())
        config = TwinConfig(
            model_dir=twin_model_dir(engine.max_model_len),
            num_blocks=engine.capacity_blocks,
            block_size=engine.block_size,
            scheduler=self.spec.scheduler,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            policy_path=policy_path,
            engine_name=self.engine_name,
            step_cost=self.profile,
            ranker=victim_ranker(self.spec.variant) if self.spec.variant else None,
        )
        harness = SchedulerHarness(config)
        if self.spec.admission:
            self.gateway = TwinGateway(
                self.policy.for_engine(self.engine_name),
                clock=lambda: harness.now,
                stats=lambda: self._engine_stats(harness),
                stats_interval=STEP_INTERVAL_S,
                max_model_len=engine.max_model_len,
                seed=self.scenario.seed,
            )
        return harness

    # -- events -------------------------------------------------------------------

    def _push(self, at: float, session: Session, turn: int, outcome: Outcome | None = None
              ) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, session, turn, outcome))

    def _engine_stats(self, harness: SchedulerHarness) -> EngineStats | None:
        """The plugin's stats as the sidecar sees them: refreshed as often as the plugin
        publishes its stats file (every `STEP_INTERVAL_S` while stepping)."""
        if harness.plugin is None:
            return None
        if self._stats is None or harness.now >= self._stats_until:
            self._stats = harness.kvq_stats()
            self._stats_until = harness.now + STEP_INTERVAL_S
        return self._stats

    def _arrive(self, harness: SchedulerHarness, event: TwinEvent) -> None:
        at, _, session, turn, outcome = event
        if outcome is None:
            outcome = Outcome(session.tenant, session.tier.value, session.session_id, turn + 1,
                              at)
            self.outcomes.append(outcome)
        outcome.attempts += 1
        prompt = self._prompts.pop((session.session_id, turn), None) or self._prompt(session, turn)
        outcome.prompt_tokens = len(prompt)
        room = self.scenario.engine.max_model_len - len(prompt)
        requested = min(session.max_tokens, room) if session.max_tokens else None
        attempt = _Attempt(session, turn, outcome, prompt, requested, at)
        if self.gateway is None:
            self._start(harness, attempt, min(session.turns[turn].output_tokens,
                                              requested or room), None)
            return
        ticket = self.gateway.submit(session.tenant, prompt, requested,
                                     session.session_id, attempt)
        if ticket.settled:
            self._settle_ticket(harness, ticket)

    def _settle_ticket(self, harness: SchedulerHarness, ticket: Ticket) -> None:
        """The sidecar's queue admitted or refused a turn: start it, or let the client
        retry after Retry-After (up to the scenario's `clients.maxAttempts`)."""
        attempt: _Attempt = ticket.payload
        session, turn, outcome = attempt.session, attempt.turn, attempt.outcome
        if ticket.waited_on is not None and ticket.waited > 0:
            reason = ticket.waited_on.value
            outcome.waited_on[reason] = outcome.waited_on.get(reason, 0.0) + ticket.waited
        if ticket.reservation is not None:
            assert ticket.verdict is not None and self.gateway is not None
            outcome.queued_seconds += ticket.waited
            room = self.scenario.engine.max_model_len - len(attempt.prompt)
            want = min(session.turns[turn].output_tokens, attempt.requested_max_tokens or room)
            outcome.cut_tokens = max(0, want - ticket.verdict.max_tokens)
            self._start(harness, attempt, min(want, ticket.verdict.max_tokens),
                        ticket.reservation, self.gateway.plugin_args(ticket))
            return
        error = ticket.error
        if error is None:  # cancelled: the twin's clients never leave
            return
        outcome.rejections.append(error.status)
        verdict = ticket.verdict
        if verdict is not None and not verdict.borrowing and verdict.decision in KV_REFUSALS:
            outcome.refused_within_guarantee += 1
        retryable = error.status in (429, 503)
        if retryable and outcome.attempts < self.scenario.clients.max_attempts:
            delay = error.retry_after or self.scenario.clients.retry_after_seconds
            self._prompts[(session.session_id, turn)] = attempt.prompt
            self._push(harness.now + delay, session, turn, outcome)
        else:
            outcome.status = "rejected"
            self._settle()

    def _start(
        self, harness: SchedulerHarness, attempt: _Attempt, max_tokens: int,
        reservation: Reservation | None, plugin_args: dict[str, int] | None = None,
    ) -> None:
        """`plugin_args`: the vllm_xargs the sidecar adds beyond tenant and session."""
        session, turn, outcome = attempt.session, attempt.turn, attempt.outcome
        tenant = self.policy.tenants[session.tenant]
        req_id = f"{session.session_id}.t{turn + 1}.a{outcome.attempts}"
        use_tenant = self.spec.scheduler == "kvquota"
        harness.add_request(
            req_id, attempt.prompt, max(1, max_tokens),
            priority=tenant.priority if self.spec.tier_priority else 0,
            tenant=session.tenant if use_tenant else None,
            session=session.session_id if use_tenant else None,
            arrival_time=outcome.arrival,
            extra_args=plugin_args if use_tenant else None,
        )
        self._tier_of_req[req_id] = session.tier.value
        self._live[req_id] = _Live(outcome, session, turn, attempt.prompt, reservation)
        if self._ttft is not None:
            # Earlier attempts and retry waits, then this attempt's time queued.
            sidecar = attempt.at - outcome.arrival + outcome.queued_seconds
            self._ttft.entered(req_id, session.tier.value, outcome.arrival, sidecar)

    def _feed_progress(self, harness: SchedulerHarness) -> None:
        """What each running turn has decoded, to its reservation, after every step: the
        sidecar reads the same off the response it streams (`Reservation.progress`
        re-estimates once per block, so this costs a comparison per running turn)."""
        live = self._live
        for request in harness.scheduler.running:
            turn = live.get(request.request_id)
            if turn is not None and turn.reservation is not None:
                turn.reservation.progress(request.num_output_tokens)

    def _prompt(self, session: Session, turn: int) -> list[int]:
        if turn == 0:
            return session.first_prompt()
        return self._contexts[session.session_id] + session.new_tokens(turn)

    def _finish(self, harness: SchedulerHarness, req_id: str) -> None:
        live = self._live.pop(req_id)
        record: TwinRequest = harness.requests[req_id]
        outcome = live.outcome
        outcome.first_token = record.first_token_time
        outcome.finish = record.finish_time
        outcome.output_tokens = len(record.output_token_ids)
        outcome.cached_tokens = record.num_cached_tokens or 0
        outcome.preemptions = record.num_preemptions
        outcome.status = "ok"
        if self._ttft is not None:
            outcome.ttft_parts = self._ttft.take(req_id)
        if live.reservation is not None:
            live.reservation.release("completed")
        self._tier_of_req.pop(req_id, None)
        self._settle()
        session, turn = live.session, live.turn
        if turn + 1 < len(session.turns):
            self._contexts[session.session_id] = live.prompt + record.output_token_ids
            assert record.finish_time is not None
            self._push(record.finish_time + session.turns[turn + 1].think_time, session, turn + 1)
        else:
            self._contexts.pop(session.session_id, None)
        # The harness keeps every request; the twin has taken what it needs.
        del harness.requests[req_id]

    def _settle(self) -> None:
        self._settled += 1

    # -- sampling -----------------------------------------------------------------

    def _sample(self, harness: SchedulerHarness) -> None:
        self.timeline.add(round(harness.now, 6), self._kv_by_tier(harness))

    def _kv_by_tier(self, harness: SchedulerHarness) -> dict[str, int]:
        """KV blocks held per tier: running requests' blocks and the plugin's leases."""
        manager = harness.scheduler.kv_cache_manager
        by_tier: dict[str, int] = {}
        for request in harness.scheduler.running:
            tier = self._tier_of_req.get(request.request_id)
            if tier is not None:
                by_tier[tier] = by_tier.get(tier, 0) + len(
                    manager.get_block_ids(request.request_id)[0]
                )
        stats = self._engine_stats(harness)
        if stats is not None:
            for tenant_id, tenant_stats in stats.tenants.items():
                if tenant_id in self.scenario.tenants and tenant_stats.leased_blocks:
                    tier = self.scenario.tier_of(tenant_id).value
                    by_tier[tier] = by_tier.get(tier, 0) + tenant_stats.leased_blocks
        return by_tier

    # -- occupancy ----------------------------------------------------------------

    def _observe_step(self, harness: SchedulerHarness, start: float, free_blocks: int) -> None:
        """KV in use during the step that ran from `start` (what it allocated)."""
        used = max(0, self.scenario.engine.capacity_blocks - 1 - free_blocks)  # 1: null block
        self.occupancy.add_kv(start, harness.now, used)
        self._observe_tenants(harness)

    def _advance_idle(self, harness: SchedulerHarness, seconds: float) -> None:
        """Let virtual time pass with nothing to step; the blocks leases pin stay in use."""
        free = harness.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        used = max(0, self.scenario.engine.capacity_blocks - 1 - free)
        self.occupancy.add_kv(harness.now, harness.now + seconds, used)
        harness.advance(seconds)
        self._observe_tenants(harness)

    def _observe_tenants(self, harness: SchedulerHarness) -> None:
        """Each tenant's held blocks (running + leased) as the sidecar last read the
        plugin's stats, and its requests in flight, held since the previous call."""
        if harness.plugin is None:
            return
        self.occupancy.add_tenants(self._tenants_at, harness.now, self._held, self._inflight)
        self._tenants_at = harness.now
        stats = self._stats if self._stats is not None else self._engine_stats(harness)
        if stats is None:
            return
        self._held = {t: s.running_blocks + s.leased_blocks for t, s in stats.tenants.items()}
        gateway = self.gateway
        if gateway is not None and stats is not self._charged_at:
            self._charged_at = stats
            self.charges.read(harness.now, gateway.charge_readings(self.scenario.tenants))
        self._inflight = (
            {t: gateway.ledger.inflight(t) for t in self.scenario.tenants}
            if gateway is not None
            else {t: s.running + s.waiting for t, s in stats.tenants.items()}
        )

    # -- the loop -----------------------------------------------------------------

    def run(self) -> RunResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        with tempfile.TemporaryDirectory(prefix="kvquota-twin-", dir=self.work_dir) as tmp:
            harness = self._harness(Path(tmp))
            try:
                result = self._loop(harness)
            finally:
                harness.shutdown()
        result.wall_seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu_started
        return result

    def _loop(self, harness: SchedulerHarness) -> RunResult:
        for session in self.sessions:
            self._push(session.start, session, 0)
        interval = self.scenario.duration / TIMELINE_SAMPLES
        next_sample = 0.0
        deadline = self.scenario.duration + self.scenario.drain_timeout
        notes: list[str] = []
        steps = 0
        last_report = -1.0
        gateway = self.gateway
        engine = self.scenario.engine
        self._ttft = TtftLedger(self.profile, engine.max_num_batched_tokens, engine.max_num_seqs)
        while self._events or harness.has_unfinished() or (gateway and gateway.queue.waiting()):
            while self._events and self._events[0][0] <= harness.now:
                self._arrive(harness, heapq.heappop(self._events))
            if gateway is not None:
                for ticket in gateway.poll():
                    self._settle_ticket(harness, ticket)
            if not harness.has_unfinished():
                wakeups = [self._events[0][0]] if self._events else []
                if gateway is not None and (wakeup := gateway.next_wakeup()) is not None:
                    wakeups.append(wakeup)
                if wakeups:
                    self._advance_idle(harness, max(0.0, min(wakeups) - harness.now))
                continue
            if harness.now >= deadline:
                notes.append(
                    f"stopped at {harness.now:.0f} s (duration + drainTimeout) with "
                    f"{len(self._live)} requests unfinished"
                )
                break
            record = harness.step()
            steps += 1
            self._ttft.step(record, self._tier_of_req)
            self._observe_step(harness, record.start_time, record.num_free_blocks)
            if gateway is not None:
                self._feed_progress(harness)
            for req_id in record.finished_req_ids:
                if req_id in self._live:
                    self._finish(harness, req_id)
            if harness.now >= next_sample:
                self._sample(harness)
                next_sample = harness.now + interval
            if not record.num_scheduled_tokens and not harness.scheduler.running:
                # Nothing fits and nothing runs that could free memory: only a new event
                # can change that.
                wakeups = [self._events[0][0]] if self._events else []
                if gateway is not None and (wakeup := gateway.next_wakeup()) is not None:
                    wakeups.append(wakeup)
                if not wakeups:
                    notes.append(f"stalled at {harness.now:.0f} s: {len(self._live)} requests "
                                 "could not be scheduled")
                    break
                self._advance_idle(harness, max(0.0, min(wakeups) - harness.now))
            if self.progress is not None and harness.now - last_report >= 1.0:
                last_report = harness.now
                self.progress(self.spec.key, self._settled, self._planned, harness.now)
            # Keep memory flat on long runs: the twin consumed each step already.
            if len(harness.steps) > 4096:
                del harness.steps[:-1]
        self._sample(harness)
        makespan = max((o.finish for o in self.outcomes if o.finish is not None), default=0.0)
        result = RunResult(
            key=self.spec.key,
            label=self.spec.label,
            outcomes=self.outcomes,
            timeline=self.timeline,
            makespan=makespan,
            steps=steps,
            notes=notes,
            occupancy=self.occupancy,
        )
        if harness.plugin is not None:
            result.has_leases = True
            stats = harness.kvq_stats()
            result.extra = plugin_extra(stats)
            tier_of = {t: self.scenario.tier_of(t).value for t in self.scenario.tenants}
            result.outgrown_by_tier = outgrown_by_tier(stats, tier_of)
            result.above_max_by_tier = above_max_by_tier(stats, tier_of)
            if self.gateway is not None:
                result.extra["charges"] = self.charges.to_json()
                waits: dict[str, float] = {}
                for tenant_id, seconds in self.gateway.queue.idle_waits.items():
                    tier = tier_of.get(tenant_id)
                    if tier is not None:
                        waits[tier] = waits.get(tier, 0.0) + seconds
                result.beside_idle_kv = waits
            for tenant_id, tenant_stats in stats.tenants.items():
                if tenant_id in self.scenario.tenants:
                    tier = self.scenario.tier_of(tenant_id).value
                    result.lease_breaks[tier] = (
                        result.lease_breaks.get(tier, 0) + tenant_stats.lease_breaks
                    )
        if self.progress is not None:
            self.progress(self.spec.key, self._planned, self._planned, harness.now)
        return result


def plugin_extra(stats: EngineStats) -> dict[str, Any]:
    reasons: dict[str, int] = {}
    drops: dict[str, int] = {}
    for tenant_stats in stats.tenants.values():
        for reason, count in tenant_stats.preemptions.items():
            reasons[reason] = reasons.get(reason, 0) + count
        for reason, count in tenant_stats.lease_drops.items():
            drops[reason] = drops.get(reason, 0) + count
    return {
        "preemptionsByReason": {str(k): v for k, v in sorted(reasons.items())},
        "leaseDrops": {str(k): v for k, v in sorted(drops.items())},
        "degradedEpisodes": stats.degraded_episodes,
        "idleLeaseBlockSeconds": round(
            sum(t.idle_lease_block_seconds for t in stats.tenants.values()), 1
        ),
    }


def run_twin(
    scenario: Scenario,
    sessions: list[Session],
    spec: PolicySpec,
    profile: CostProfile,
    progress: Progress | None = None,
) -> RunResult:
    return TwinRun(scenario, sessions, spec, profile, progress=progress).run()


# -- several runs, in parallel processes --------------------------------------------
