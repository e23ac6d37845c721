"""The noisy-neighbour workload, driven by engine state rather than by the clock.

Premium tenants hold multi-turn conversations; between turns a free-tier wave of long
parallel prompts (`kvquota_lab.burst`, a client of its own) tries to fill the KV cache:

- round 0: every conversation sends its first turn to the idle engine (cold: nothing is
  cached yet; what a turn costs without any queue);
- round r >= 1: a wave of `burst_requests` free prompts; once the wave holds the cache
  (`BurstGauge`, read from the engine's telemetry) every conversation sends its next
  turn; the round ends when the turns and the wave are done. While the wave fills the
  cache the conversations are idle, as a user reading the last answer is. A wave that
  ends before it held the cache (a loaded machine can feed it in slower than the
  engine drains it) is followed by another; after `hold_timeout` the turns go anyway
  and are counted as not held.

Free requests that are refused (429/503) are retried, no sooner than Retry-After and
backing off (`retry_delay`), until `burst_timeout`: the wave is the same work in both
runs, and a sidecar that queues instead of refusing sees the same client. While each
round's turns are in flight the client times its own event loop's wake-ups: how late
it runs is what the machine adds to every timing it takes (`Result.client_lag`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import replace

import httpx

from kvquota_lab.burst import BurstClient, BurstSpec, Wave
from kvquota_lab.engine_state import BurstGauge, Hold
from kvquota_lab.loadgen import NoisyNeighbour, Result, complete, tokens
from kvquota_lab.stream_client import Target

HOLD_POLL_SECONDS = 0.1
LAG_TICK_SECONDS = 0.01


async def _worst_lag(done: asyncio.Event) -> float:
    """How late this event loop woke up from short sleeps, at worst, until `done`. The
    client does little else while turns are in flight (the burst has a process of its
    own), so lateness here is the machine's: under a millisecond when it is idle."""
    worst = 0.0
    while not done.is_set():
        start = time.perf_counter()
        await asyncio.sleep(LAG_TICK_SECONDS)
        worst = max(worst, time.perf_counter() - start - LAG_TICK_SECONDS)
    return worst


class WaveStalled(RuntimeError):
    """A free wave did not finish within its bound: the engine stopped making progress."""


class _Conversation:
    def __init__(self, w: NoisyNeighbour, index: int) -> None:
        self.w = w
        self.rng = random.Random(f"{w.seed}-chat-{index}")
        self.session = f"{w.premium_tenant}-chat-{index}"
        self.context = tokens(self.rng, w.premium_prompt_tokens)
        self.turn = 0

    async def next_turn(self, client: httpx.AsyncClient, target: Target, round_no: int,
                        clock_start: float, hold: Hold | None) -> Result:
        self.turn += 1
        result, answer = await complete(
            client, target, "premium", self.w.premium_tenant, self.context,
            self.w.premium_max_tokens, turn=self.turn, round_no=round_no,
            session=self.session, clock_start=clock_start,
        )
        self.context = [*self.context, *answer, *tokens(self.rng, self.w.turn_tokens)]
        if round_no == 0:
            return result
        return replace(result, held=hold.reason if hold else None,
                       engine_waiting=hold.engine_waiting if hold else None)


class _Workload:
    """One run of the workload against one target (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, burst: BurstClient, target: Target,
                 w: NoisyNeighbour, gauge: BurstGauge, say: Callable[[str], None]) -> None:
        self.client, self.burst, self.target = client, burst, target
        self.w, self.gauge, self.say = w, gauge, say
        self.conversations = [_Conversation(w, i) for i in range(w.premium_sessions)]
        self.out: list[Result] = []
        self.start = time.perf_counter()

    async def run(self) -> list[Result]:
        warm = random.Random(f"{self.w.seed}-warmup")
        # Warm-up, not measured: the first request of each shape loads and compiles.
        for length in (8, self.w.burst_prompt_tokens):
            await complete(self.client, self.target, "warmup", self.w.free_tenant,
                           tokens(warm, length), 2)
        self.start = time.perf_counter()
        await self._turns(0, None)
        for round_no in range(1, self.w.turns):
            await self._round(round_no)
        return self.out

    async def _turns(self, round_no: int, hold: Hold | None) -> None:
        done = asyncio.Event()
        lag = asyncio.create_task(_worst_lag(done))
        try:
            results = await asyncio.gather(*(
                c.next_turn(self.client, self.target, round_no, self.start, hold)
                for c in self.conversations
            ))
        finally:
            done.set()
        worst = await lag
        self.out.extend(replace(r, client_lag=worst) if round_no else r for r in results)

    async def _round(self, round_no: int) -> None:
        deadline = time.perf_counter() + self.w.hold_timeout
        wave = self.burst.launch(round_no, self.start)
        hold = await self._await_hold(wave, deadline)
        while hold is None and wave.done.is_set() and time.perf_counter() < deadline:
            # A loaded machine can trickle a wave into the engine slower than the engine
            # drains it: that wave never held the cache, so send another.
            self.say(f"round {round_no}: the wave ended before it held the cache "
                     f"({self.gauge.last_seen()}); sending another")
            wave = self.burst.launch(round_no, self.start)
            hold = await self._await_hold(wave, deadline)
        if hold is None:
            self.say(f"round {round_no}: the free burst did not hold the cache within "
                     f"{self.w.hold_timeout:.0f}s ({self.gauge.last_seen()}); premium turns "
                     "sent anyway, counted as not held")
        else:
            self.say(f"round {round_no}: burst holds the cache ({hold.reason}); "
                     f"{len(self.conversations)} premium follow-ups")
        await self._turns(round_no, hold)
        bound = self.w.burst_timeout + self.w.request_timeout
        try:
            await asyncio.wait_for(wave.done.wait(), bound)
        except TimeoutError:
            raise WaveStalled(f"round {round_no}: the free wave did not finish in {bound:.0f}s "
                              f"({self.gauge.last_seen()})") from None
        if self.burst.error:
            raise WaveStalled(f"round {round_no}: {self.burst.error}")

    async def _await_hold(self, wave: Wave, deadline: float) -> Hold | None:
        """Poll until the wave holds the cache, ends, or `deadline` (perf_counter)."""
        while time.perf_counter() < deadline and not wave.done.is_set():
            hold = await self.gauge.holds(self.client, wave.pending, wave.unanswered)
            if hold is not None:
                return hold
            await asyncio.sleep(HOLD_POLL_SECONDS)
        return None


async def run_noisy_neighbour(
    target: Target, w: NoisyNeighbour, gauge: BurstGauge,
    say: Callable[[str], None] = lambda message: None,
) -> list[Result]:
    """Every request's measurements: the premium turns' and the free burst's."""
    spec = BurstSpec(target.url, target.model, target.headers(w.free_tenant), w)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with BurstClient(spec) as burst, httpx.AsyncClient(
        timeout=w.request_timeout, limits=limits
    ) as client:
        workload = _Workload(client, burst, target, w, gauge, say)
        out = await workload.run()
    return [*out, *burst.results]
