"""Fixtures for running the real operator (kopf) against the KMock API emulator.

KMock's API is young (pre-1.0), so it stays behind these fixtures,
`operator_harness` and `kvquota.emulator`: tests talk to a `Cluster` (plain HTTP),
run the operator with `OperatorRunner` (kopf in its own thread and loop) and fake
engines with `FakeEngines`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from operator_harness import WAIT, Cluster, FakeEngines, ManualClock

from kvquota.emulator import OperatorRunner, serve
from kvquota.runtime import OperatorConfig


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
