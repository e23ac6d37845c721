"""Fixtures for running the real operator (kopf) against the KMock API emulator.

KMock's API is young (pre-1.0), so it stays behind these fixtures,
`operator_harness` and `kvquota_lab.emulator`: tests talk to a `Cluster` (plain HTTP),
run the operator with `OperatorRunner` (kopf in its own thread and loop) and fake
engines with `FakeEngines`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from operator_harness import WAIT, Cluster, FakeEngines, ManualClock

from kvquota.runtime import OperatorConfig
from kvquota_lab.emulator import OperatorRunner, serve
from kvquota_lab.emulator_process import OperatorProcess


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with serve() as (server, url), aiohttp.ClientSession() as session:
        yield Cluster(server, url, session)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def operator_config(cluster: Cluster, clock: ManualClock) -> OperatorConfig:
    return OperatorConfig(api_server=cluster.url, poll_interval=0.2, engine_timeout=0.5,
                          degraded_window=300.0, clock=clock)


@pytest.fixture
async def operator(operator_config: OperatorConfig) -> AsyncIterator[OperatorRunner]:
    runner = OperatorRunner(operator_config)
    await runner.start(WAIT)
    try:
        yield runner
    finally:
        await runner.stop(WAIT)


@pytest.fixture
async def engines(cluster: Cluster) -> AsyncIterator[FakeEngines]:
    fakes = FakeEngines(cluster)
    try:
        yield fakes
    finally:
        await fakes.close()


SpawnOperator = Callable[..., Awaitable[OperatorProcess]]


@pytest.fixture
async def spawn_operator(cluster: Cluster, tmp_path: Path) -> AsyncIterator[SpawnOperator]:
    """Start `kvquota operator` processes against the emulator (`identity`, extra
    flags); every one still running is stopped at the end."""
    started: list[OperatorProcess] = []

    async def spawn(identity: str, *args: str) -> OperatorProcess:
        process = OperatorProcess(cluster.url, tmp_path, identity=identity, args=args)
        started.append(process)
        await process.start(WAIT)
        return process

    try:
        yield spawn
    finally:
        for process in started:
            await process.stop()
