"""The event loop's lag and the garbage collector's pauses, for the perf harness.

A latency tail while the sidecar's core is mostly idle is a pause, not work: a
collection, or a callback that holds the loop. Every stream in flight waits through it at
once. This probe tells which: a ticker task that sleeps `INTERVAL_S` and records how
late it woke (the loop's lag), and a `gc.callbacks` hook that times each collection per
generation. A late tick (`LATE_MS`) is split by where its time went: collecting, other
work of this thread (its CPU time), or off the CPU (the thread was runnable but
descheduled: other processes on the core, which on a quiet machine is near nothing).

Off unless `$KVQUOTA_PAUSE_PROBE` names a file (`names.PAUSE_PROBE_ENV`): it costs a
wake-up every few ms and a callback per collection, which production does not need.
The file is rewritten (atomically) every `WRITE_EVERY_S` with cumulative histograms, so
a reader takes the difference of two snapshots (`PauseSnapshot.since`). uvloop's timers
have millisecond resolution: lag below ~1 ms is the timer's, not the loop's.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import gc
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_sidecar.contract.names import PAUSE_PROBE_ENV

INTERVAL_S = 0.005
WRITE_EVERY_S = 0.25
# Bucket upper edges in ms: 0.05 ms to ~3.3 s, each 2**(1/4) (19%) above the one before.
EDGES_MS: tuple[float, ...] = tuple(0.05 * 2 ** (k / 4) for k in range(65))
LATE_MS = 2.0  # a tick this late is accounted for (`PauseSnapshot.late`)
EVENT_MS = 2.0  # lag ticks and collections at least this long are also kept one by one
MAX_EVENTS = 4096


@dataclass
class Histogram:
    """Counts per `EDGES_MS` bucket (the last one open-ended), their sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(EDGES_MS) + 1))
    total_ms: float = 0.0

    def add(self, ms: float) -> None:
        self.counts[bisect.bisect_left(EDGES_MS, ms)] += 1
        self.total_ms += ms

    @property
    def n(self) -> int:
        return sum(self.counts)

    def since(self, before: Histogram) -> Histogram:
        return Histogram([a - b for a, b in zip(self.counts, before.counts, strict=True)],
                         self.total_ms - before.total_ms)

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bucket holding quantile `q` (None: empty; inf: beyond the
        last edge)."""
        n = self.n
        if not n:
            return None
        rank, seen = q * n, 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= rank and count:
                return EDGES_MS[i] if i < len(EDGES_MS) else float("inf")
        return float("inf")

    def over(self, ms: float) -> int:
        """How many were above `ms` (bucket resolution)."""
        return sum(self.counts[bisect.bisect_left(EDGES_MS, ms) + 1:])

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "total_ms": self.total_ms}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Histogram:
        return cls(list(data["counts"]), float(data["total_ms"]))


@dataclass
class LateTicks:
    """Ticks at least `LATE_MS` late: how many, their wall time from the tick before, and
    where it went (collections; this thread's CPU time, collections included; the rest
    is time off the CPU, less the ticker's own sleeps)."""

    n: int = 0
    lag_ms: float = 0.0
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    gc_ms: float = 0.0

    def since(self, before: LateTicks) -> LateTicks:
        return LateTicks(self.n - before.n, self.lag_ms - before.lag_ms,
                         self.wall_ms - before.wall_ms, self.cpu_ms - before.cpu_ms,
                         self.gc_ms - before.gc_ms)

    @property
    def off_cpu_ms(self) -> float:
        """Wall time neither sleeping as asked nor running: the thread waited for a CPU."""
        return max(0.0, self.wall_ms - self.n * INTERVAL_S * 1000 - self.cpu_ms)


@dataclass
class PauseSnapshot:
    """What the probe saw since it started (`since`: between two snapshots)."""

    lag: Histogram = field(default_factory=Histogram)
    late: LateTicks = field(default_factory=lambda: LateTicks())
    gc: dict[int, Histogram] = field(default_factory=lambda: {g: Histogram() for g in range(3)})
    # The same collections' CPU time (this thread's): what a busy machine cannot inflate.
    gc_cpu: dict[int, Histogram] = field(
        default_factory=lambda: {g: Histogram() for g in range(3)})
    # (wall time, "lag" | "gc0" | "gc1" | "gc2", ms) for pauses of at least EVENT_MS.
    events: list[tuple[float, str, float]] = field(default_factory=list)
    written: float = 0.0  # wall time of this snapshot

    def since(self, before: PauseSnapshot) -> PauseSnapshot:
        return PauseSnapshot(
            self.lag.since(before.lag), self.late.since(before.late),
            {g: h.since(before.gc[g]) for g, h in self.gc.items()},
            {g: h.since(before.gc_cpu[g]) for g, h in self.gc_cpu.items()},
            [e for e in self.events if e[0] > before.written], self.written)

    def to_json(self) -> dict[str, Any]:
        return {"lag": self.lag.to_json(), "late": dataclasses.asdict(self.late),
                "gc": {str(g): h.to_json() for g, h in self.gc.items()},
                "gc_cpu": {str(g): h.to_json() for g, h in self.gc_cpu.items()},
                "events": self.events, "written": self.written,
                "edges_ms": EDGES_MS, "interval_ms": INTERVAL_S * 1000}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PauseSnapshot:
        return cls(Histogram.from_json(data["lag"]), LateTicks(**data["late"]),
                   {int(g): Histogram.from_json(h) for g, h in data["gc"].items()},
                   {int(g): Histogram.from_json(h) for g, h in data["gc_cpu"].items()},
                   [(float(t), str(k), float(ms)) for t, k, ms in data["events"]],
                   float(data["written"]))

    @classmethod
    def read(cls, path: Path) -> PauseSnapshot | None:
        """The file's snapshot; None when there is none (yet), e.g. an older sidecar."""
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            return None


class PauseProbe:
    """Measures while `run` runs; `gc.callbacks` holds its hook only meanwhile."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.snapshot = PauseSnapshot()
        self._events: deque[tuple[float, str, float]] = deque(maxlen=MAX_EVENTS)
        self._gc_started = 0.0
        self._gc_started_cpu = 0.0
        self._gc_ms = 0.0  # all collections so far

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if phase == "start":
            self._gc_started, self._gc_started_cpu = now, cpu
            return
        ms = (now - self._gc_started) * 1000
        self._gc_ms += ms
        generation = info["generation"]
        self.snapshot.gc[generation].add(ms)
        self.snapshot.gc_cpu[generation].add((cpu - self._gc_started_cpu) * 1000)
        if ms >= EVENT_MS:
            self._events.append((time.time(), f"gc{generation}", ms))

    async def run(self) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            await self._tick()
        finally:
            gc.callbacks.remove(self._on_gc)

    async def _tick(self) -> None:
        snapshot, late = self.snapshot, self.snapshot.late
        last, last_cpu, last_gc = time.perf_counter(), time.thread_time(), self._gc_ms
        next_write = last + WRITE_EVERY_S
        while True:
            await asyncio.sleep(INTERVAL_S)
            now, cpu, gc_ms = time.perf_counter(), time.thread_time(), self._gc_ms
            lag = max(0.0, (now - last - INTERVAL_S) * 1000)
            snapshot.lag.add(lag)
            if lag >= LATE_MS:
                late.n += 1
                late.lag_ms += lag
                late.wall_ms += (now - last) * 1000
                late.cpu_ms += (cpu - last_cpu) * 1000
                late.gc_ms += gc_ms - last_gc
            if lag >= EVENT_MS:
                self._events.append((time.time(), "lag", lag))
            if now >= next_write:
                self._write()
                next_write = now + WRITE_EVERY_S
                # The write is the probe's own work, not the loop's lag.
                now, cpu = time.perf_counter(), time.thread_time()
            last, last_cpu, last_gc = now, cpu, gc_ms

    def _write(self) -> None:
        self.snapshot.events = list(self._events)
        self.snapshot.written = time.time()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.snapshot.to_json()))
        os.replace(tmp, self.path)


def probe_from_env() -> PauseProbe | None:
    """The probe `$KVQUOTA_PAUSE_PROBE` asks for, if any."""
    path = os.environ.get(PAUSE_PROBE_ENV)
    return PauseProbe(Path(path)) if path else None
