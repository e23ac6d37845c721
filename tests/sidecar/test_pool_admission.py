"""Pool-wide admission on a real Redis: a tenant that routing sends to one engine gets
its idle share from the other through the shared ledger, never more than its pool-wide
maxBlocks; with the store down each engine keeps to what it had claimed."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine_sidecar.contract.policy import EnginePolicy, PoolLimits, PoolStorePolicy
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import UNKNOWN_CAPACITY, RequestShape
from engine_sidecar.gateway.pool.admission import REASK_S, PoolAdmission
from engine_sidecar.gateway.pool.link import PoolLink
from engine_sidecar.gateway.pool.store import Outcome, PoolStore, connect
from engine_sidecar.gateway.telemetry.metrics import StateCollector, StateSources
from engine_sidecar.gateway.telemetry.status import DecisionCounters, build_status
from tests.support.redis_server import RedisServer

from .helpers import make_policy, tenant

BLOCK = 32
TTL_S = 0.6
POLICY = make_policy(tenant(
    "acme", guaranteed_blocks=5, max_blocks_per_engine=10, max_tokens=4096, max_queue_seconds=30,
    max_queued_requests=100,
    pool_wide=PoolLimits(guaranteed_blocks=10, max_blocks=20)))
# The same tenant on engines of 12 blocks whose watermark keeps 3 free: alone, an engine
# admits it 9 (its 5 guaranteed, then 4 borrowed down to the floor).
SMALL_ENGINES = POLICY.model_copy(update={"capacity_blocks": 12, "watermark": 0.25})


class _Clock:
    now = 0.0


def _engine(server: RedisServer | None, name: str,
            policy: EnginePolicy = POLICY) -> AdmissionQueue:
    ledger = Ledger()
    queue = AdmissionQueue(ledger, clock=lambda: _Clock.now, rng=random.Random(1),
                           max_model_len=lambda: None)
    # As the sidecar wires it: a released reservation reaches the pool-wide ledger.
    ledger.on_release = lambda reservation: queue.released(reservation.tenant_id)
    queue.set_policy(policy)
    if server is not None:
        store = PoolStore(connect(server.address, None, timeout_s=0.05), "ns/pool", name,
                          ttl_s=TTL_S, margin_blocks=2)
        queue.pool = PoolAdmission(store)
    return queue


def _started(server: RedisServer,
             policy: EnginePolicy = POLICY) -> tuple[AdmissionQueue, AdmissionQueue]:
    a, b = _engine(server, "a", policy), _engine(server, "b", policy)
    _refresh(a, b)
    time.sleep(TTL_S)  # the new store's grace
    _refresh(a, b)
    return a, b


def _one_block() -> RequestShape:
    return RequestShape((BLOCK - 1,), 1)


def _refresh(*queues: AdmissionQueue) -> None:
    for q in queues:
        assert q.pool is not None and q.policy is not None
        assert q.pool.refresh(q.policy, q.view())


def _admitted(tickets: list[Ticket]) -> int:
    return sum(t.admitted for t in tickets)


def test_without_a_store_one_engine_admits_its_split_only() -> None:
    a = _engine(None, "a")
    assert _admitted([a.submit("acme", _one_block()) for _ in range(20)]) == 10


def test_a_tenant_routed_to_one_engine_gets_the_other_engines_idle_share(
        server: RedisServer) -> None:
    a, b = _started(server)
    on_a = [a.submit("acme", _one_block()) for _ in range(25)]
    assert _admitted(on_a) == 10  # its split; the store refuses more: b claims its 10
    _refresh(b, a)  # b idle: after that refusal its allowance shrinks to its margin (2)
    a.pump()
    assert _admitted(on_a) == 18  # 20 pool-wide less b's 2
    on_b = [b.submit("acme", _one_block()) for _ in range(3)]
    assert _admitted(on_b) == 2 and not on_b[2].settled  # waits: the pool is full
    assert a.pool is not None and a.pool.charges[Outcome.POOL] > 0
    for ticket in on_a[:5]:
        assert ticket.reservation is not None
        ticket.reservation.release()
    # a's claim was above its allowance (b waits on it): its releases reach the store
    # at once, not at a's next refresh; b's queued request asks again once REASK_S has
    # passed, not at every pump (each ask is a round trip).
    assert b.pool is not None and isinstance(b.pool.store, PoolStore)
    trips = b.pool.store.round_trips
    b.pump()
    assert not on_b[2].settled and b.pool.store.round_trips == trips
    _Clock.now += REASK_S
    b.pump()
    assert on_b[2].admitted


def test_after_a_refusal_what_fits_the_allowance_is_still_admitted_with_no_round_trip(
        server: RedisServer) -> None:
    """The store refused a request of the tenant on a; for REASK_S a asks the store
    nothing more, but a smaller request within what a has claimed goes in locally."""
    a, b = _started(server)
    assert _admitted([b.submit("acme", _one_block()) for _ in range(10)]) == 10
    assert _admitted([a.submit("acme", _one_block()) for _ in range(8)]) == 8
    big = a.submit("acme", RequestShape((3 * BLOCK - 1,), 1))  # past a's split of 10
    assert not big.settled  # the pool is full: b holds 10, a claims 10
    assert a.pool is not None and isinstance(a.pool.store, PoolStore)
    trips = a.pool.store.round_trips
    small = a.submit("acme", RequestShape((2 * BLOCK - 1,), 1))
    assert small.admitted and a.pool.store.round_trips == trips
    assert not big.settled


def test_a_tenant_within_its_pool_wide_guarantee_gets_the_watermarks_room(
        server: RedisServer) -> None:
    """Routing sends the tenant to engine a only: past the watermark there, it is still
    within its pool-wide guarantee (10), so the store lets it into the free blocks the
    watermark keeps, up to that guarantee counted over both engines, no further."""
    a, b = _started(server, SMALL_ENGINES)
    on_a = [a.submit("acme", _one_block()) for _ in range(12)]
    assert a.pool is not None and b.pool is not None
    assert _admitted(on_a) == 10 and a.pool.within_guarantee == 1
    assert not on_a[10].settled  # 11 would pass the guarantee: it waits for room
    on_b = [b.submit("acme", _one_block()) for _ in range(2)]
    assert _admitted(on_b) == 2  # within b's own split: no round trip
    _refresh(b)  # b's holdings reach the store at its refresh
    on_a[0].reservation.release()  # type: ignore[union-attr]
    _Clock.now += REASK_S
    a.pump()
    assert not on_a[10].settled  # 9 on a + 2 on b + 1 > 10 pool-wide
    for ticket in on_b:
        ticket.reservation.release()  # type: ignore[union-attr]
    _refresh(b)
    _Clock.now += REASK_S
    a.pump()
    assert on_a[10].admitted and not on_a[11].settled  # 10 again, all on a
    assert a.pool.within_guarantee == 2
    # What a platform team reads on the admin port's /metrics.
    registry = CollectorRegistry()
    registry.register(StateCollector(StateSources(
        ledger=a.ledger, active=lambda: None, stats=lambda: None, label=str, queue=a)))
    metrics = generate_latest(registry).decode()
    assert "kvquota_pool_store_guarantee_admissions_total 2.0" in metrics
    assert 'kvquota_pool_store_charges_total{outcome="local"} 9.0' in metrics


def test_a_request_about_to_be_refused_asks_the_store_once_more(server: RedisServer) -> None:
    """Asked again no sooner than REASK_S, except for a request whose refusal would be
    its answer: at its deadline it gets a fresh decision, so room another engine gave
    back a moment ago is not missed."""
    a, b = _started(server, SMALL_ENGINES)
    on_b = [b.submit("acme", _one_block()) for _ in range(2)]
    _refresh(b)  # the store sees b's 2
    on_a = [a.submit("acme", _one_block()) for _ in range(10)]
    assert _admitted(on_a) == 9  # 2 + 9 + 1 would pass the pool-wide guarantee of 10
    last = on_a[9]
    _Clock.now = last.deadline - REASK_S / 5
    a.pump()  # asks again (long past REASK_S): still no
    assert not last.settled
    for ticket in on_b:
        ticket.reservation.release()  # type: ignore[union-attr]
    _refresh(b)
    _Clock.now = last.deadline
    a.pump()
    assert last.admitted


def test_store_down_keeps_each_engine_to_what_it_claimed(server: RedisServer) -> None:
    a, b = _started(server)
    on_a = [a.submit("acme", _one_block()) for _ in range(15)]
    _refresh(b, a)
    a.pump()
    assert _admitted(on_a) == 15
    server.kill()
    # a holds 15 (granted); b may use only its 2 claimed blocks, not its split of 10.
    assert not a.submit("acme", _one_block()).admitted
    assert a.pool is not None and a.pool.store.reachable is False  # the sidecar's status
    assert _admitted([b.submit("acme", _one_block()) for _ in range(5)]) == 2
    assert not _refresh_ok(a)


def _refresh_ok(q: AdmissionQueue) -> bool:
    assert q.pool is not None and q.policy is not None
    return q.pool.refresh(q.policy, q.view())


def test_the_sidecar_reads_the_store_password_from_its_own_secret_and_never_logs_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cret-for-the-pool-store"
    srv = RedisServer(tmp_path, password=secret)
    srv.start()
    try:
        secrets, store_secrets = tmp_path / "secrets", tmp_path / "pool-store"
        secrets.mkdir()
        store_secrets.mkdir()
        (store_secrets / "password").write_text(secret + "\n")
        store = PoolStorePolicy(address=srv.address, password_file="password",
                                ttl_seconds=1, timeout_ms=50)
        policy = POLICY.model_copy(update={"pool_store": store})
        caplog.set_level(logging.DEBUG)
        admission = PoolLink(secrets, "engine-a", store_secrets_dir=store_secrets).for_policy(
            policy)
        assert admission is not None
        assert admission.refresh(policy, UNKNOWN_CAPACITY)  # authenticated
        # Where earlier releases said to put it, in the pool's auth Secret: still read.
        (secrets / "redis-password").write_text(secret + "\n")
        legacy = policy.model_copy(update={"pool_store": store.model_copy(
            update={"password_file": "redis-password"})})
        admission = PoolLink(secrets, "engine-d", store_secrets_dir=store_secrets).for_policy(
            legacy)
        assert admission is not None and admission.refresh(legacy, UNKNOWN_CAPACITY)
        # Without the file the link stays off, saying why in the sidecar's status (for
        # the pool's StoreDegraded condition); once the Secret is mounted, it connects
        # with no restart.
        missing = POLICY.model_copy(update={"pool_store": store.model_copy(
            update={"password_file": "absent"})})
        link = PoolLink(secrets, "engine-b")
        assert link.for_policy(missing) is None and link.for_policy(missing) is None
        assert secret not in caplog.text and caplog.text.count("key absent") == 1  # once
        status = build_status(ready=True, active=None, policy_error=None, ledger=Ledger(),
                              counters=DecisionCounters(), stats=None, capacity=None,
                              queue=AdmissionQueue(Ledger(), clock=time.monotonic),
                              pool_store_problem=link.problem)
        assert status.pool_store_reachable is False
        assert status.pool_store_problem is not None and "absent" in status.pool_store_problem
        (secrets / "absent").write_text(secret + "\n")
        admission = link.for_policy(missing)
        assert admission is not None and admission.refresh(missing, UNKNOWN_CAPACITY)
        assert link.problem is None
        link.close()
        # A policy without a store: no pool-wide admission.
        assert PoolLink(secrets, "engine-c").for_policy(POLICY) is None
    finally:
        srv.kill()
