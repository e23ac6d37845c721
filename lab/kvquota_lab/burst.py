"""The free tier's client: waves of long prompts, sent from a process of its own.

A noisy neighbour is another client. In the measuring client's event loop the burst's
hundreds of requests, retries and streams kept the loop busy for seconds at a time on
a loaded machine, and premium TTFT then measured the load generator, not the engine.
Here the burst runs in a child process and reports back, per request, when the server
first answered it (accepted, refused, or admitted from a queue) and when it streamed
its first token, and every attempt's `Result`. Timestamps are `time.perf_counter()`,
the system's monotonic clock, so both processes' `sent_at` share one time axis.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import random
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import httpx

from kvquota_lab.loadgen import (
    RETRYABLE,
    NoisyNeighbour,
    Result,
    complete,
    retry_delay,
    tokens,
)
from kvquota_lab.stream_client import Target

STOP_SECONDS = 10.0
READY_SECONDS = 60.0


@dataclass(frozen=True)
class BurstSpec:
    """What the burst process needs (picklable: it crosses into the child)."""

    url: str
    model: str
    headers: dict[str, str]
    workload: NoisyNeighbour


class Wave:
    """One wave as the parent sees it. A request is *unanswered* until the server first
    answers it and *pending* until it streams a token; `done` once all have finished."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.unanswered = self.pending = size
        self.done = asyncio.Event()


class BurstFailed(RuntimeError):
    """The burst process ended before its waves did."""


class BurstClient:
    """Parent side: starts the burst process, launches waves, collects their results."""

    def __init__(self, spec: BurstSpec) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a running event loop
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, spec), daemon=True,
                                        name="kvquota-burst")
        self._child_conn = child
        self._wave_size = spec.workload.burst_requests
        self._waves: dict[int, Wave] = {}
        self.results: list[Result] = []
        self.error: str | None = None

    async def __aenter__(self) -> BurstClient:
        self._process.start()
        self._child_conn.close()
        # Python's start-up and imports in the child take a core for a second or so:
        # wait them out, so they do not land on the first measured requests.
        ready = await asyncio.to_thread(self._conn.poll, READY_SECONDS)
        if not ready or self._conn.recv() != ("ready",):
            raise BurstFailed(f"the free-tier client process did not start in "
                              f"{READY_SECONDS:.0f}s (exit code {self._process.exitcode})")
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._on_readable)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._conn.fileno())
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        await asyncio.to_thread(self._process.join, STOP_SECONDS)
        if self._process.is_alive():
            self._process.terminate()
            await asyncio.to_thread(self._process.join, STOP_SECONDS)
        self._on_readable()  # the results sent before it stopped
        self._conn.close()

    def launch(self, round_no: int, clock_start: float) -> Wave:
        if self.error:
            raise BurstFailed(self.error)
        wave_id = len(self._waves) + 1
        wave = self._waves[wave_id] = Wave(self._wave_size)
        self._conn.send(("wave", wave_id, round_no, clock_start))
        return wave

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            code = self._process.exitcode
            self.error = self.error or f"the free-tier client process exited (code {code})"
            for wave in self._waves.values():
                wave.done.set()
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._conn.fileno())

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind, wave_id = message[0], message[1]
        wave = self._waves[wave_id]
        if kind == "answer":
            wave.unanswered -= 1
        elif kind == "place":
            wave.pending -= 1
        elif kind == "result":
            self.results.append(message[2])
        elif kind == "done":
            wave.done.set()


def _serve(conn: Connection, spec: BurstSpec) -> None:
    """Child process: run waves on command until told to stop."""
    conn.send(("ready",))
    asyncio.run(_Burst(conn, spec).run())


class _Burst:
    def __init__(self, conn: Connection, spec: BurstSpec) -> None:
        self.conn, self.spec, self.w = conn, spec, spec.workload
        self.target = Target(spec.url, spec.model, lambda _tenant: spec.headers)
        self.rng = random.Random(f"{self.w.seed}-burst")

    async def run(self) -> None:
        commands: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

        def readable() -> None:
            try:
                while self.conn.poll():
                    commands.put_nowait(self.conn.recv())
            except (EOFError, OSError):  # the parent is gone
                commands.put_nowait(("stop",))

        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), readable)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        waves: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=self.w.request_timeout, limits=limits) as client:
            while (command := await commands.get())[0] != "stop":
                _, wave_id, round_no, clock_start = command
                task = asyncio.create_task(self._wave(client, wave_id, round_no, clock_start))
                waves.add(task)
                task.add_done_callback(waves.discard)
            for task in waves:
                task.cancel()
            await asyncio.gather(*waves, return_exceptions=True)
        loop.remove_reader(self.conn.fileno())

    def _send(self, *message: Any) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(message)

    async def _wave(self, client: httpx.AsyncClient, wave_id: int, round_no: int,
                    clock_start: float) -> None:
        prompts = [tokens(self.rng, self.w.burst_prompt_tokens)
                   for _ in range(self.w.burst_requests)]
        try:
            await asyncio.gather(*(
                self._request(client, wave_id, round_no, clock_start, prompt,
                              random.Random(self.rng.random()))
                for prompt in prompts
            ))
        finally:
            self._send("done", wave_id)

    async def _request(self, client: httpx.AsyncClient, wave_id: int, round_no: int,
                       clock_start: float, prompt: list[int], rng: random.Random) -> None:
        answered = placed = False

        def answer() -> None:
            nonlocal answered
            if not answered:
                answered = True
                self._send("answer", wave_id)

        def place() -> None:
            nonlocal placed
            if not placed:
                placed = True
                self._send("place", wave_id)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.w.burst_timeout
        refusals = 0
        try:
            while True:
                result, _ = await complete(
                    client, self.target, "free", self.w.free_tenant, prompt,
                    self.w.burst_max_tokens, round_no=round_no, clock_start=clock_start,
                    on_answer=answer, on_first_token=place,
                )
                self._send("result", wave_id, result)
                if result.status not in RETRYABLE or loop.time() >= deadline:
                    return
                refusals += 1
                await asyncio.sleep(retry_delay(result.retry_after, refusals, rng))
        finally:
            answer()
            place()
