"""The sidecar's pool-wide admission on a real Redis, wired as the sidecar wires it
(`PoolLink`, its store thread, the pump it wakes). It never waits on the store on the
event loop: while the store is slow to answer one tenant's charge, another tenant's
request that its own allowance covers is admitted at once, and the first when the
store's answer comes. A store outage mid-run keeps each engine to what it had claimed,
and pool-wide admission is back within one TTL of the store's return."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import redis

from engine_sidecar.contract.policy import EnginePolicy, PoolLimits, PoolStorePolicy
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import RequestShape
from engine_sidecar.gateway.pool.link import PoolLink
from engine_sidecar.gateway.pool.store import PoolStore
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


class _Engine:
    """One sidecar's admission, wired as the sidecar wires it (`PoolLink`)."""

    def __init__(self, name: str, policy: EnginePolicy) -> None:
        self.changed = asyncio.Event()
        self.ledger = Ledger()
        self.queue = AdmissionQueue(self.ledger, clock=time.monotonic, rng=random.Random(1),
                                    max_model_len=lambda: None)
        self.ledger.on_release = lambda reservation: self.queue.released(
            reservation.tenant_id)
        self.queue.set_policy(policy)
        self.link = PoolLink(None, name)
        self.link.wake = self.changed.set
        self.queue.pool = self.link.for_policy(policy)
        assert self.queue.pool is not None
        self.policy = policy

    @property
    def store(self) -> PoolStore:
        assert self.queue.pool is not None and isinstance(self.queue.pool.store, PoolStore)
        return self.queue.pool.store

    async def refreshed(self) -> None:
        """A refresh, once its round trip is done (on the store thread)."""
        assert self.queue.pool is not None
        trips = self.store.round_trips
        self.queue.pool.refresh(self.policy, self.queue.view())
        async with asyncio.timeout(10):
            while self.store.round_trips == trips and self.store.reachable:
                await asyncio.sleep(0.01)

    async def submit(self, n: int) -> list[Ticket]:
        """`n` one-block requests of acme, each decided (the store answered, if asked)."""
        tickets = []
        for _ in range(n):
            tickets.append(self.queue.submit("acme", _blocks(1)))
            await self.settled()
        return tickets

    async def admitted(self, tickets: list[Ticket]) -> int:
        """Pump until every ticket is admitted (a take-back whose peer answered too late
        for one request is asked again at a later pump); how many were, at most 10 s on."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                while not all(t.admitted for t in tickets):
                    await asyncio.sleep(0.02)
                    self.queue.pump()
                    await self.settled()
        return sum(t.admitted for t in tickets)

    async def settled(self) -> None:
        assert self.queue.pool is not None
        async with asyncio.timeout(10):
            while self.queue.pool.asking("acme"):
                await self.changed.wait()
                self.changed.clear()
                self.queue.pump()


async def _published(*engines: _Engine) -> None:
    """Each engine has refreshed past the new store's grace: its claims are on the store."""
    for engine in engines:
        await engine.refreshed()
    await asyncio.sleep(TTL_S)  # the new store's grace
    for engine in engines:
        await engine.refreshed()


async def test_a_store_outage_keeps_each_engine_to_its_claim_and_recovers_within_a_ttl(
        server: RedisServer) -> None:
    policy = make_policy(
        tenant("acme", guaranteed_blocks=5, max_blocks_per_engine=10, max_tokens=1,
               default_max_tokens=1, max_queue_seconds=30, max_queued_requests=100,
               pool_wide=PoolLimits(guaranteed_blocks=10, max_blocks=20)),
        pool_store=PoolStorePolicy(address=server.address, ttl_seconds=TTL_S, timeout_ms=50))
    a, b = _Engine("engine-a", policy), _Engine("engine-b", policy)
    try:
        await _published(a, b)
        for engine in (a, b):
            assert await asyncio.to_thread(engine.store.subscribed.wait, 10)
        # Up: routing sends acme to a, which borrows b's idle share through the store.
        on_a = await a.submit(15)
        assert await a.admitted(on_a) == 15
        server.kill()
        # Down, mid-run: each engine keeps to what it had claimed. a holds 15 (granted
        # by the store) and gets no more; b's allowance was taken back for a, so it
        # admits nothing beyond it: the pool never passes 20.
        more_on_a, on_b = await a.submit(3), await b.submit(10)
        assert sum(t.admitted for t in more_on_a) == 0
        on_b_down = sum(t.admitted for t in on_b)
        assert 15 + on_b_down <= 20 and on_b_down <= 10
        assert not a.store.reachable and not b.store.reachable
        for ticket in on_a:  # a's requests end while the store is down
            assert ticket.reservation is not None
            ticket.reservation.release("completed")
        server.start()  # back, empty: one TTL of grace while the sidecars republish
        await _published(a, b)
        for engine in (a, b):
            # listening again (it retries within a quarter of a TTL): a take-back needs it
            assert await asyncio.to_thread(engine.store.subscribed.wait, 10)
        # Pool-wide again: b's waiting requests go in, and b borrows a's idle share.
        assert await b.admitted(on_b) == 10
        more_on_b = await b.submit(5)
        assert await b.admitted(more_on_b) == 5  # 15 on b, past its split of 10
    finally:
        for engine in (a, b):
            engine.link.close()


async def test_a_request_past_its_deadline_is_refused_on_the_stores_no(
        server: RedisServer) -> None:
    # a and b claim acme's whole pool-wide maxBlocks; a's next request waits for the
    # store, which says no; past its queue deadline it is refused with that no (429),
    # not kept asking again at every answer.
    policy = make_policy(
        tenant("acme", guaranteed_blocks=5, max_blocks_per_engine=10, max_tokens=1,
               default_max_tokens=1, max_queue_seconds=0.2, max_queued_requests=100,
               above_max="Never",
               pool_wide=PoolLimits(guaranteed_blocks=10, max_blocks=20)),
        pool_store=PoolStorePolicy(address=server.address, ttl_seconds=TTL_S, timeout_ms=50))
    a, b = _Engine("engine-a", policy), _Engine("engine-b", policy)
    try:
        await _published(a, b)
        assert all(t.admitted for t in await b.submit(10) + await a.submit(10))
        [late] = await a.submit(1)
        assert not late.settled  # waits: the store said no
        await asyncio.sleep(0.3)  # past its deadline
        async with asyncio.timeout(10):
            a.queue.pump()
            while not late.settled:
                await a.changed.wait()
                a.changed.clear()
                a.queue.pump()
        assert late.error is not None and late.error.status == 429
    finally:
        for engine in (a, b):
            engine.link.close()
