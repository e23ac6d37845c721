"""The `engine` backend: a scenario against the real vLLM CPU server, in wall time.

Each policy gets a fresh engine (the tiny model, the scenario's `engine` settings,
`--enable-prompt-tokens-details`):

- `fcfs`: stock vLLM, `--scheduling-policy fcfs`, requests sent straight to it;
- `priority`: stock vLLM, `--scheduling-policy priority`, each request carrying its
  tier's priority;
- `kvquota`: vLLM with the TenantAwareScheduler plugin behind the sidecar. The sidecar
  serves the EnginePolicy rendered from the scenario's tenants, with the tenant taken
  from a trusted header (no JWTs to mint); sessions travel as `X-Session-Id`;
- the baseline: stock FCFS without the noisy tiers.

Prompts are token ids (the same generator as the twin); each turn resends the
conversation with the tokens the engine generated (`return_token_ids`). A request
sends the client's `max_tokens`, as in the twin, and the model ends its answer after
the turn's drawn output length, as a model ends at its end of sequence
(`answer_fields`): the engine finishes the request normally ("stop"), so the sidecar
relays a completed answer of that length and learns its output estimate from it.
Refused requests are retried after Retry-After, as in the twin. The noisy tiers (those
the baseline drops) are played by a client process of their own: in one event loop
their hundreds of streams and retries held the loop for up to 1.6 s on 2 cores, and
premium TTFT then measured the load generator.
KV usage per tier comes from the plugin's stats file (KVQuota); for stock vLLM from
`/metrics` (`vllm:kv_cache_usage_perc`, a total), so every engine the bench starts keeps
vLLM's stats (the same cost for each policy), and the KV in use compares across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import AuthPolicy
from engine_sidecar.contract.stats import EngineStats
from kvquota_lab.bench.metrics import Outcome, RunResult, Timeline
from kvquota_lab.bench.occupancy import Occupancy
from kvquota_lab.bench.plugin_counts import above_max_by_tier, outgrown_by_tier
from kvquota_lab.bench.policies import BASELINE, POLICIES, PolicySpec
from kvquota_lab.bench.scenario import TIER_ORDER, Scenario, Session, generate_sessions
from kvquota_lab.bench.twin import Progress
from kvquota_lab.stream_client import Streamed, Target, completion_body, stream_completion

if TYPE_CHECKING:
    import httpx

    from kvquota_lab.stack import Processes

TENANT_HEADER = "x-kvquota-bench-tenant"
# Plugin preemption reasons that are lease releases, not running requests.
_LEASE_REASONS = frozenset({"lease_break", "degraded"})
SAMPLE_SECONDS = 0.5


def kv_bytes_per_token() -> int:
    """K and V of every layer for one token of the tiny model (2-byte KV cache on CPU)."""
    from kvquota_lab.tinymodel import MODEL_CONFIG

    return int(2 * MODEL_CONFIG["num_hidden_layers"] * MODEL_CONFIG["num_key_value_heads"]
               * MODEL_CONFIG["head_dim"] * 2)


def parse_server_timing(values: list[str]) -> dict[str, float]:
    """`name;dur=ms` entries of Server-Timing headers (W3C); others are skipped."""
    timings: dict[str, float] = {}
    for entry in (e for value in values for e in value.split(",")):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    timings[name] = float(value)
    return timings


# The answer's tokens: FILL until its last one, END (two ordinary ids of the tiny
# model's vocabulary, above its special tokens).
ANSWER_FILL, ANSWER_END = 100, 101
END_BIAS = 100.0


def answer_fields(answer_tokens: int) -> dict[str, Any]:
    """Sampling fields that make the model stop after exactly `answer_tokens` tokens, as
    at its end of sequence, whatever `max_tokens` allows: only FILL and END may be
    generated; END is a stop token that `min_tokens` masks until the answer's last
    position, where its bias makes it the greedy choice. A random-weight model has no
    end of sequence of its own to stop at."""
    return {
        "min_tokens": max(0, answer_tokens - 1),
        "allowed_token_ids": [ANSWER_FILL, ANSWER_END],
        "stop_token_ids": [ANSWER_END],
        "logit_bias": {str(ANSWER_END): END_BIAS},
    }


async def complete(
    client: httpx.AsyncClient, target: Target, tenant: str, prompt: list[int],
    max_tokens: int | None, *, session: str | None, priority: int | None,
    clock: Callable[[], float], answer_tokens: int | None = None,
) -> Streamed:
    """One streamed completion of token ids; times come from `clock()`. The answer
    ends at the max_tokens in force, or after `answer_tokens` when that is fewer
    (`max_tokens` None: not sent)."""
    body = completion_body(target.model, prompt, max_tokens)
    if answer_tokens is not None and (max_tokens is None or answer_tokens < max_tokens):
        body.update(answer_fields(answer_tokens))
    if priority is not None:
        body["priority"] = priority
    return await stream_completion(client, target.url, body,
                                   target.request_headers(tenant, session), clock=clock)


class _Driver:
    """Plays the scenario's sessions against one target in wall time."""

    def __init__(self, scenario: Scenario, sessions: list[Session], spec: PolicySpec,
                 target: Target, progress: Progress | None,
                 warmup: Target | None = None) -> None:
        self.scenario = scenario
        # The engine itself: through the sidecar, warm-up answers would teach a tenant's
        # output estimate (and count in its status) as if it had sent them.
        self.warmup = warmup or target
        self.sessions = sessions
        self.spec = spec
        self.target = target
        self.progress = progress
        self.policy = scenario.engine_policy()
        self.outcomes: list[Outcome] = []
        self.planned = sum(len(s.turns) for s in sessions)
        self.settled = 0
        self.cached_unknown = False
        self.t0 = 0.0

    def clock(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        """Warm up, then play the sessions: the noisy tiers' from a child process when
        the scenario has both kinds."""
        import httpx

        noisy = set(self.scenario.baseline.drop_tiers)
        own = [s for s in self.sessions if s.tier not in noisy]
        others = [s for s in self.sessions if s.tier in noisy]
        if not own or not others:
            own, others = self.sessions, []
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with contextlib.AsyncExitStack() as stack:
            # Started first: its interpreter start-up must not overlap measured requests.
            noise = await stack.enter_async_context(
                _NoiseClient(self, others)) if others else None
            client = await stack.enter_async_context(
                httpx.AsyncClient(timeout=600.0, limits=limits))
            # Warm-up (first allocations, shapes of a long prefill and of a batch):
            # not measured. Distinct prompts, so nothing of it is cached for the run.
            tenant = next(iter(self.policy.tenants))
            length = min(1024, self.scenario.engine.max_model_len // 2)
            await asyncio.gather(*(
                complete(client, self.warmup, tenant, [16 + (i + k) % 2000 for k in range(
                    length if i == 0 else 64)], 4, session=None, priority=None,
                    clock=time.monotonic)
                for i in range(8)
            ))
            self.t0 = time.monotonic()
            if noise is None:
                await self.play(client, own)
            else:  # read the child's progress meanwhile, so its pipe never fills
                noise.go(self.t0)
                await asyncio.gather(self.play(client, own), noise.collect())

    @property
    def deadline(self) -> float:
        """Seconds after t0 when unfinished sessions are cancelled."""
        return self.scenario.duration + self.scenario.drain_timeout

    async def play(self, client: httpx.AsyncClient, sessions: list[Session]) -> None:
        tasks = [asyncio.create_task(self._session(client, s)) for s in sessions]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.deadline)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _session(self, client: httpx.AsyncClient, session: Session) -> None:
        await asyncio.sleep(max(0.0, session.start - self.clock()))
        context: list[int] = []
        tenant = self.policy.tenants[session.tenant]
        for index, turn in enumerate(session.turns):
            if index:
                await asyncio.sleep(turn.think_time)
                prompt = context + session.new_tokens(index)
            else:
                prompt = session.first_prompt()
            outcome = Outcome(session.tenant, session.tier.value, session.session_id,
                              index + 1, self.clock(), prompt_tokens=len(prompt))
            self.outcomes.append(outcome)
            room = self.scenario.engine.max_model_len - len(prompt)
            # What the client sends (as in the twin), and where the answer ends: at its
            # drawn length, or at the max_tokens in force (the sidecar clamps it to the
            # tier's ceiling or applies the tier's default; a min_tokens above it would
            # be refused).
            requested = max(1, min(session.max_tokens, room)) if session.max_tokens else None
            use_sidecar = self.spec.admission
            in_force = requested or room
            if use_sidecar:
                in_force = (min(requested, tenant.max_tokens) if requested
                            else tenant.default_max_tokens)
            answer = max(1, min(turn.output_tokens, in_force, room))
            outcome.cut_tokens = max(0, min(turn.output_tokens, requested or room) - answer)
            reply = None
            while outcome.attempts < self.scenario.clients.max_attempts:
                outcome.attempts += 1
                try:
                    reply = await complete(
                        client, self.target, session.tenant, prompt, requested,
                        session=session.session_id if use_sidecar else None,
                        priority=tenant.priority if self.spec.tier_priority and not use_sidecar
                        else None,
                        clock=self.clock, answer_tokens=answer,
                    )
                except Exception:  # a malformed stream
                    reply = None
                if reply is None or reply.status == 0:  # or no answer: the session ends
                    outcome.status = "failed"
                    break
                if reply.status in (429, 503):
                    outcome.rejections.append(reply.status)
                    await asyncio.sleep(
                        reply.retry_after or self.scenario.clients.retry_after_seconds
                    )
                    continue
                break
            self.settle()
            if reply is None or reply.status != 200:
                if outcome.status != "failed":
                    outcome.status = "rejected" if outcome.rejections else "failed"
                return
            outcome.status = "ok"
            outcome.first_token = reply.first_token
            outcome.finish = reply.finish
            outcome.sent, outcome.headers = reply.sent, reply.head
            outcome.server_timing = parse_server_timing(reply.server_timing)
            outcome.output_tokens = len(reply.token_ids)
            # the sidecar's x-kvquota-queue-ms (none from stock vLLM)
            outcome.queued_seconds = (reply.queue_ms or 0.0) / 1000
            if reply.cached_tokens is None:
                self.cached_unknown = True
            else:
                outcome.cached_tokens = reply.cached_tokens
            context = prompt + reply.token_ids

    def settle(self) -> None:
        self.settled += 1
        if self.progress is not None:
            self.progress(self.spec.key, self.settled, self.planned, self.clock())


NOISE_READY_SECONDS = 60.0
NOISE_GRACE_SECONDS = 30.0  # after the deadline, for the child to send its outcomes


class NoiseClientFailed(RuntimeError):
    """The noisy tiers' client process did not start or did not report."""


class _NoiseClient:
    """Parent side of the noisy tiers' client process: it plays `sessions` on the
    parent's clock (time.monotonic is system-wide) and sends back their outcomes."""

    def __init__(self, driver: _Driver, sessions: list[Session]) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a running event loop
        self._driver = driver
        self._conn, child = context.Pipe()
        self._child = child
        self._process = context.Process(
            target=_play_noise, daemon=True, name="kvquota-bench-noise",
            args=(child, driver.scenario, sessions, driver.spec, driver.target),
        )

    async def __aenter__(self) -> _NoiseClient:
        self._process.start()
        self._child.close()
        ready = await asyncio.to_thread(self._conn.poll, NOISE_READY_SECONDS)
        try:
            if ready and self._conn.recv() == ("ready",):
                return self
        except EOFError:
            pass
        raise NoiseClientFailed(f"the noisy tiers' client did not start in "
                                f"{NOISE_READY_SECONDS:.0f}s (exit code "
                                f"{self._process.exitcode})")

    async def __aexit__(self, *_exc: object) -> None:
        self._conn.close()  # a child still playing sees EOF when it reports
        await asyncio.to_thread(self._process.join, NOISE_GRACE_SECONDS)
        if self._process.is_alive():
            self._process.terminate()
            await asyncio.to_thread(self._process.join, NOISE_GRACE_SECONDS)

    def go(self, t0: float) -> None:
        self._conn.send(("go", t0))

    async def collect(self) -> None:
        """Relay the child's progress until it reports its outcomes."""
        driver = self._driver
        loop = asyncio.get_running_loop()
        reported: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                while not reported.done() and self._conn.poll():
                    message = self._conn.recv()
                    if message[0] == "settled":
                        driver.settle()
                        continue
                    _, outcomes, cached_unknown = message
                    driver.outcomes.extend(outcomes)
                    driver.cached_unknown |= cached_unknown
                    reported.set_result(None)
            except (EOFError, OSError):
                reported.set_exception(NoiseClientFailed(
                    f"the noisy tiers' client exited (code {self._process.exitcode})"))

        loop.add_reader(self._conn.fileno(), readable)
        limit = driver.t0 + driver.deadline + NOISE_GRACE_SECONDS
        try:
            await asyncio.wait_for(reported, max(0.0, limit - time.monotonic()))
        except TimeoutError:
            raise NoiseClientFailed("the noisy tiers' client did not report in time") from None
        finally:
            loop.remove_reader(self._conn.fileno())


def _play_noise(conn: Connection, scenario: Scenario, sessions: list[Session],
                spec: PolicySpec, target: Target) -> None:
    """Child process: wait for the parent's t0, play the sessions, send the outcomes."""
    def send(*message: Any) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: its run failed
            conn.send(message)

    driver = _Driver(scenario, sessions, spec, target, progress=lambda *_: send("settled"))
    send("ready")
    try:
        _, driver.t0 = conn.recv()
    except EOFError:
        return  # the parent gave up before the run started

    async def play() -> None:
        import httpx

        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            await driver.play(client, sessions)

    asyncio.run(play())
    send("outcomes", driver.outcomes, driver.cached_unknown)


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    try:
        resp = await client.get(f"{url}/metrics")
    except Exception:
        return values
    for line in resp.text.splitlines():
        match = _METRIC.match(line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


async def _sample(driver: _Driver, timeline: Timeline, stats_path: Path | None,
                  engine_url: str, tier_of: dict[str, str], stop: asyncio.Event,
                  occupancy: Occupancy) -> None:
    """Every SAMPLE_SECONDS: KV held per tier for the timeline and, where the engine
    tells, blocks in use and each tenant's held blocks and requests for `occupancy`
    (a sample's values stand until the next one)."""
    import httpx

    last: tuple[float, int | None, dict[str, int], dict[str, int]] | None = None
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            if driver.t0:
                now = driver.clock()
                by_tier: dict[str, int] = {}
                used: int | None = None
                held: dict[str, int] = {}
                inflight: dict[str, int] = {}
                if stats_path is not None:
                    stats = _read_stats(stats_path)
                    for tenant, t in (stats.tenants if stats else {}).items():
                        held[tenant] = t.used_blocks
                        inflight[tenant] = t.running + t.waiting
                        tier = tier_of.get(tenant)
                        if tier is not None:
                            by_tier[tier] = by_tier.get(tier, 0) + t.used_blocks
                    if stats is not None and stats.total_blocks:
                        used = stats.total_blocks - stats.free_blocks
                else:
                    usage = (await _scrape(client, engine_url)).get("vllm:kv_cache_usage_perc")
                    if usage is not None:
                        by_tier["all"] = round(usage * timeline.capacity)
                        used = by_tier["all"]
                if last is not None:
                    at, was_used, was_held, was_inflight = last
                    if was_used is not None:
                        occupancy.add_kv(at, now, was_used)
                    if stats_path is not None:
                        occupancy.add_tenants(at, now, was_held, was_inflight)
                last = (now, used, held, inflight)
                timeline.add(round(now, 3), by_tier)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_SECONDS)


def _read_stats(path: Path) -> EngineStats | None:
    try:
        return EngineStats.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _TrustedTenant:
    """`Target.headers` for the sidecar's trusted tenant header (picklable: the noisy
    tiers' client process gets it too)."""

    def __call__(self, tenant: str) -> dict[str, str]:
        return {TENANT_HEADER: tenant}


@dataclass(frozen=True)
class RunningEngine:
    """An engine with the plugin that is already up (e.g. a test session's): the
    KVQuota policy runs against it as it is, instead of starting one."""

    url: str
    policy_path: Path
    stats_path: Path


def _start_stack(
    procs: Processes, spec: PolicySpec, scenario: Scenario, model: Path, run: Path,
    existing: RunningEngine | None = None,
) -> tuple[dict[str, str], str, Target]:
    """Start what `spec` needs; returns the engine's environment, its URL, the target."""
    from engine_sidecar.contract.names import POLICY_PATH_ENV, STATS_PATH_ENV
    from kvquota_lab.stack import engine_process, sidecar_process

    if existing is not None and spec.scheduler == "kvquota":
        engine_url = existing.url
        engine_env = {POLICY_PATH_ENV: str(existing.policy_path),
                      STATS_PATH_ENV: str(existing.stats_path)}
    else:
        engine_spec = scenario.engine
        extra = ["--enable-prompt-tokens-details",
                 "--max-num-batched-tokens", str(engine_spec.max_num_batched_tokens)]
        if spec.scheduler == "stock-priority":
            extra += ["--scheduling-policy", "priority"]  # the last one given wins
        engine, engine_url = engine_process(
            model, run, f"vllm-{spec.key}", plugin=spec.scheduler == "kvquota",
            kv_cache_bytes=engine_spec.capacity_blocks * engine_spec.block_size
            * kv_bytes_per_token(),
            extra_args=extra, block_size=engine_spec.block_size,
            max_model_len=engine_spec.max_model_len, max_num_seqs=engine_spec.max_num_seqs,
            log_stats=True,
        )
        procs.start(engine).wait_http(engine_url + "/health", 300)
        engine_env = engine.env
    if not spec.admission:
        return engine_env, engine_url, Target(engine_url, str(model))
    policy = scenario.engine_policy().model_copy(update={
        "model": str(model), "auth": AuthPolicy(trusted_tenant_header=TENANT_HEADER),
    }).with_version()
    policy_file = run / "policy-source.json"
    write_atomically(policy_file, policy.to_json())
    secrets_dir = run / "secrets"
    secrets_dir.mkdir(parents=True, exist_ok=True)
    (secrets_dir / "cache-salt").write_text(secrets.token_hex(32))
    sidecar, sidecar_url = sidecar_process(
        engine_env, engine_url, run, policy_file=policy_file, secrets_dir=secrets_dir,
        tokenizer=model,
        extra_args=["--retry-after", str(scenario.clients.retry_after_seconds)],
    )
    procs.start(sidecar).wait_http(sidecar_url + "/readyz", 120)
    return engine_env, engine_url, Target(sidecar_url, str(model), _TrustedTenant())


def _stats_path(engine_env: dict[str, str]) -> Path | None:
    from engine_sidecar.contract.names import STATS_PATH_ENV

    value = engine_env.get(STATS_PATH_ENV)
    return Path(value) if value else None


REQUESTS_FILE = "requests.jsonl"


def _write_requests(path: Path, outcomes: list[Outcome]) -> None:
    """Every request's timeline (arrival, sent, headers, first token, finish, in run
    seconds), one JSON object a line, in arrival order: where a slow request's time
    went, the sidecar and vLLM's front end or the engine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for outcome in sorted(outcomes, key=lambda o: o.arrival):
            out.write(json.dumps(asdict(outcome), separators=(",", ":")) + "\n")


def slowest_first_token(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """Where the top tier's slowest first token spent its time, in ms: until the
    response head (the sidecar's admission and the engine's front end, by the
    sidecar's Server-Timing when it is there), then until the first token."""
    tier = next((t.value for t in TIER_ORDER if any(o.tier == t.value for o in outcomes)),
                None)
    timed = [o for o in outcomes if o.tier == tier and o.ttft is not None
             and o.sent is not None and o.headers is not None]
    if not timed:
        return None
    slow = max(timed, key=lambda o: o.ttft or 0.0)
    assert slow.first_token is not None and slow.sent is not None and slow.headers is not None
    return {
        "tier": tier, "turn": slow.turn, "arrival": round(slow.arrival, 3),
        "ttftMs": round((slow.first_token - slow.arrival) * 1000, 1),
        "beforeSendMs": round((slow.sent - slow.arrival) * 1000, 1),  # refused attempts
        "toHeadMs": round((slow.headers - slow.sent) * 1000, 1),
        "headToFirstTokenMs": round((slow.first_token - slow.headers) * 1000, 1),
        "sidecar": slow.server_timing,
    }


def _describe_slowest(slow: dict[str, Any]) -> str:
    sidecar = slow["sidecar"]
    inside = (f" (sidecar admission {sidecar['admit']:.0f} ms, engine until its head "
              f"{sidecar['upstream']:.0f} ms)"
              if {"admit", "upstream"} <= sidecar.keys() else "")
    refused = (f"{slow['beforeSendMs']:.0f} ms of refused attempts + "
               if slow["beforeSendMs"] >= 1 else "")
    return (f"{slow['tier']}'s slowest first token (turn {slow['turn']} at "
            f"{slow['arrival']:.1f}s): {slow['ttftMs']:.0f} ms = {refused}"
            f"{slow['toHeadMs']:.0f} ms to the response head{inside} + "
            f"{slow['headToFirstTokenMs']:.0f} ms to the first token; every request's "
            f"timeline is in {REQUESTS_FILE}")


def run_engine_policy(
    scenario: Scenario, sessions: list[Session], spec: PolicySpec, run: Path,
    progress: Progress | None = None, *, existing: RunningEngine | None = None,
    model: Path | None = None,
) -> RunResult:
    from kvquota_lab.stack import Processes, terminate_as_interrupt, tiny_model

    started = time.perf_counter()
    model = model or tiny_model()
    procs = Processes()
    timeline = Timeline(capacity=scenario.engine.capacity_blocks)
    occupancy = Occupancy.for_scenario(scenario)
    tier_of = {tid: t.tier.value for tid, t in scenario.tenants.items()}
    try:
        with terminate_as_interrupt():
            engine_env, engine_url, target = _start_stack(
                procs, spec, scenario, model, run, existing
            )
            stats_path = _stats_path(engine_env) if spec.scheduler == "kvquota" else None
            driver = _Driver(scenario, sessions, spec, target, progress,
                             warmup=Target(engine_url, target.model))

            async def main() -> dict[str, float]:
                stop = asyncio.Event()
                sampler = asyncio.create_task(
                    _sample(driver, timeline, stats_path, engine_url, tier_of, stop, occupancy)
                )
                try:
                    await driver.run()
                finally:
                    stop.set()
                    await sampler
                import httpx

                async with httpx.AsyncClient(timeout=5.0) as client:
                    return await _scrape(client, engine_url)

            metrics = asyncio.run(main())
            final = _read_stats(stats_path) if stats_path is not None else None
    finally:
        procs.stop_all()
    _write_requests(run / REQUESTS_FILE, driver.outcomes)
    slowest = slowest_first_token(driver.outcomes)
    makespan = max((o.finish for o in driver.outcomes if o.finish is not None), default=0.0)
    result = RunResult(
        key=spec.key, label=spec.label, outcomes=driver.outcomes, timeline=timeline,
        makespan=makespan, wall_seconds=time.perf_counter() - started, occupancy=occupancy,
    )
    if slowest is not None:
        result.extra["slowestFirstToken"] = slowest
        result.notes.append(_describe_slowest(slowest))
    preempted = metrics.get("vllm:num_preemptions_total")
    # None: the engine exports no stats (kvquota_lab.processes starts it with
    # --disable-log-stats), so stock vLLM's preemptions and KV usage are unknown.
    result.extra["enginePreemptions"] = None if preempted is None else int(preempted)
    if driver.cached_unknown:
        result.prefix_known = False
        result.notes.append("the engine does not report cached prompt tokens (start it with "
                            "--enable-prompt-tokens-details); prefix hit rates are unknown")
    if final is not None:
        result.has_leases = True
        reasons: dict[str, int] = {}
        by_tier: dict[str, int] = {}
        hits: dict[str, list[int]] = {}
        for tenant, t in final.tenants.items():
            tier = tier_of.get(tenant)
            if tier is not None:
                result.lease_breaks[tier] = result.lease_breaks.get(tier, 0) + t.lease_breaks
                running = sum(c for r, c in t.preemptions.items() if r not in _LEASE_REASONS)
                by_tier[tier] = by_tier.get(tier, 0) + running
                seen = hits.setdefault(tier, [0, 0])
                seen[0] += t.prefix_hit_tokens
                seen[1] += t.prompt_tokens
            for reason, count in t.preemptions.items():
                reasons[reason] = reasons.get(reason, 0) + count
        result.preemptions_by_tier = by_tier
        result.outgrown_by_tier = outgrown_by_tier(final, tier_of)
        result.above_max_by_tier = above_max_by_tier(final, tier_of)
        result.extra["preemptionsByReason"] = dict(sorted(reasons.items()))
        # The plugin's own count, over every request (first turns included).
        result.extra["pluginPrefixHitRate"] = {
            tier: round(hit / prompt, 4) for tier, (hit, prompt) in sorted(hits.items())
            if prompt
        }
    else:
        result.preemptions_known = False
        total = result.extra["enginePreemptions"]
        result.notes.append(
            "stock vLLM does not attribute preemptions to requests; engine total: "
            + ("unknown (no /metrics stats)" if total is None else str(total))
        )
    return result


def run_engine_bench(
    scenario: Scenario, sessions: list[Session], policies: list[str],
    base_scenario: Scenario | None, progress: Progress | None, *,
    run_dir: Path | None = None,
) -> tuple[list[RunResult], RunResult | None]:
    unknown = [p for p in policies if p not in POLICIES or p == "plugin"]
    if unknown:
        raise ValueError(f"engine backend policies: fcfs, priority, kvquota (not {unknown})")
    with tempfile.TemporaryDirectory(prefix="kvquota-bench-") as tmp:
        root = run_dir or Path(tmp)
        runs = [run_engine_policy(scenario, sessions, POLICIES[key], root / key, progress)
                for key in policies]
        baseline = None
        if base_scenario is not None:
            baseline = run_engine_policy(base_scenario, generate_sessions(base_scenario),
                                         BASELINE, root / "baseline", progress)
    return runs, baseline
