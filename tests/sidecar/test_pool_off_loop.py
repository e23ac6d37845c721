"""The sidecar never waits on its pool store on the event loop: while the store is slow
to answer one tenant's charge, another tenant's request that its own allowance covers is
admitted at once, and the first is admitted when the store's answer comes (on a real
Redis, wired as the sidecar wires it: `PoolLink`, its store thread, the pump it wakes)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import redis

from engine_sidecar.contract.policy import PoolLimits, PoolStorePolicy
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.admission.rules import RequestShape
from engine_sidecar.gateway.pool.link import PoolLink
from tests.support.redis_server import RedisServer

from .helpers import make_policy, tenant

BLOCK = 32
TTL_S = 0.5
STORE_BUSY_S = 0.8  # the store answers nobody meanwhile (a script that runs this long)
BUSY = """
local function now() local t = redis.call('TIME') return t[1] + t[2] / 1e6 end
local start = now()
while now() - start < tonumber(ARGV[1]) do end
"""


def _blocks(n: int) -> RequestShape:
    return RequestShape((n * BLOCK - 1,), 1)


async def test_a_slow_store_holds_up_only_the_request_that_asked_it(
        server: RedisServer) -> None:
    policy = make_policy(
        tenant("acme", guaranteed_blocks=5, max_blocks_per_engine=10, max_tokens=1,
               default_max_tokens=1, max_queue_seconds=30, max_queued_requests=100,
               pool_wide=PoolLimits(guaranteed_blocks=10, max_blocks=40)),
        tenant("calm", guaranteed_blocks=5, max_blocks_per_engine=10, max_tokens=1,
               default_max_tokens=1, max_queue_seconds=30, max_queued_requests=100,
               pool_wide=PoolLimits(guaranteed_blocks=10, max_blocks=40)),
        pool_store=PoolStorePolicy(address=server.address, ttl_seconds=TTL_S,
                                   timeout_ms=1000))
    changed = asyncio.Event()
    ledger = Ledger()
    queue = AdmissionQueue(ledger, clock=time.monotonic, rng=random.Random(1),
                           max_model_len=lambda: None)
    queue.set_policy(policy)
    link = PoolLink(None, "engine-a")
    link.wake = changed.set
    queue.pool = link.for_policy(policy)
    assert queue.pool is not None

    async def refreshed() -> None:
        assert queue.pool is not None
        queue.pool.refresh(policy, queue.view())
        await asyncio.sleep(0.2)  # the store thread publishes

    try:
        await refreshed()
        await asyncio.sleep(TTL_S)  # the new store's grace
        await refreshed()
        # acme holds 8 of this engine's split (10); 4 more only the store can grant.
        assert all(queue.submit("acme", _blocks(4)).admitted for _ in range(2))
        busy = threading.Thread(target=lambda: redis.Redis(
            host="127.0.0.1", port=server.port).eval(BUSY, 0, STORE_BUSY_S))
        busy.start()
        await asyncio.sleep(0.1)  # the store is asleep now
        big = queue.submit("acme", _blocks(4))
        small = queue.submit("calm", _blocks(2))  # within calm's own allowance
        assert small.admitted
        assert not big.settled  # still waiting on the store: it held up nobody else
        async with asyncio.timeout(10):
            while not big.settled:
                await changed.wait()
                changed.clear()
                queue.pump()
        assert big.admitted  # granted by the store once it answered
        busy.join(10)
    finally:
        link.close()
