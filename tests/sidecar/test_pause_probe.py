"""The loop-lag and GC probe the perf harness reads: a stall and a collection show up in
its file, attributed to where they went; without its variable the sidecar runs none."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest

from engine_sidecar.contract.names import PAUSE_PROBE_ENV
from engine_sidecar.gateway.telemetry.pause_probe import (
    WRITE_EVERY_S,
    Histogram,
    PauseProbe,
    PauseSnapshot,
    probe_from_env,
)


async def _snapshot_after(path: Path) -> PauseSnapshot:
    await asyncio.sleep(WRITE_EVERY_S * 2)
    snapshot = PauseSnapshot.read(path)
    assert snapshot is not None
    return snapshot


async def test_a_stall_and_a_collection_are_in_the_difference_of_two_snapshots(
        tmp_path: Path) -> None:
    path = tmp_path / "pauses.json"
    hooks = len(gc.callbacks)
    task = asyncio.create_task(PauseProbe(path).run())
    try:
        before = await _snapshot_after(path)
        time.sleep(0.05)  # holds the loop: every tick waits
        garbage = [[i] for i in range(100_000)]
        gc.collect()
        del garbage
        after = await _snapshot_after(path)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    seen = after.since(before)
    assert max(ms for _t, kind, ms in seen.events if kind == "lag") >= 40
    assert seen.late.n >= 1 and seen.late.cpu_ms >= 40  # on the CPU: the loop's own work
    assert seen.gc[2].n >= 1 and seen.gc[2].total_ms > 0
    assert seen.gc_cpu[2].n == seen.gc[2].n and seen.gc_cpu[2].total_ms > 0
    assert (seen.lag.quantile(1.0) or 0) >= 40
    assert len(gc.callbacks) == hooks  # the hook left with the probe


def test_quantiles_read_bucket_edges() -> None:
    hist = Histogram()
    for ms in [0.1] * 98 + [10.0, 100.0]:
        hist.add(ms)
    assert hist.quantile(0.5) == pytest.approx(0.1, rel=0.2)
    assert hist.quantile(0.99) == pytest.approx(10.0, rel=0.2)
    assert hist.quantile(1.0) == pytest.approx(100.0, rel=0.2)
    assert hist.over(5.0) == 2
    assert Histogram().quantile(0.5) is None


def test_off_unless_the_variable_names_a_file(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.delenv(PAUSE_PROBE_ENV, raising=False)
    assert probe_from_env() is None
    monkeypatch.setenv(PAUSE_PROBE_ENV, str(tmp_path / "p.json"))
    probe = probe_from_env()
    assert probe is not None and probe.path == tmp_path / "p.json"
