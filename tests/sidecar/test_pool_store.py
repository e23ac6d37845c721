"""The pool-wide ledger against a real Redis: two sidecars (each its own connection)
keep a tenant within its pool-wide maxBlocks under concurrent bursts, a store restart
mid-burst loses no charge and grants nothing above maxBlocks, and a sidecar that dies
frees its charges within its TTL."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from engine_sidecar.gateway.pool.store import Limits, Outcome, PoolStore, connect
from tests.support.redis_server import RedisServer

TTL_S = 0.6  # the test's own: refresh three times per TTL, as the sidecar does
LIMITS = Limits(max_blocks=100, ceiling_blocks=50, max_requests=40, ceiling_requests=20)


def _sidecar(server: RedisServer, name: str) -> PoolStore:
    return PoolStore(connect(server.address, None, timeout_s=0.05), "ns/pool", name,
                     ttl_s=TTL_S, margin_blocks=4)


class _Pool:
    """What the sidecars' admitted requests hold together, as the engines would see it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks = self.requests = self.peak_blocks = self.peak_requests = 0
        self.outcomes: dict[Outcome, int] = dict.fromkeys(Outcome, 0)

    def burst(self, store: PoolStore, rng: random.Random, n: int,
              sizes: tuple[int, ...] = (3, 5, 8), release: float = 0.4,
              refresh_every: int = 0, limits: Limits = LIMITS) -> None:
        held: list[int] = []
        for step in range(n):
            if refresh_every and step % refresh_every == 0:
                store.refresh()
            if held and rng.random() < release:
                size = held.pop(rng.randrange(len(held)))
                with self.lock:
                    self.blocks -= size
                    self.requests -= 1
                store.release("acme", size)
                continue
            size = rng.choice(sizes)
            outcome = store.charge("acme", size, limits)
            with self.lock:
                self.outcomes[outcome] += 1
                if outcome in (Outcome.LOCAL, Outcome.POOL):
                    held.append(size)
                    self.blocks += size
                    self.requests += 1
                    self.peak_blocks = max(self.peak_blocks, self.blocks)
                    self.peak_requests = max(self.peak_requests, self.requests)
        for size in held:
            with self.lock:
                self.blocks -= size
                self.requests -= 1
            store.release("acme", size)


def _started(server: RedisServer) -> tuple[PoolStore, PoolStore]:
    """Two sidecars past the new store's grace, each allowed its split (50)."""
    a, b = _sidecar(server, "engine-a"), _sidecar(server, "engine-b")
    for s in (a, b):
        assert s.refresh({"acme": LIMITS})
    time.sleep(TTL_S)  # the first contact's grace
    for s in (a, b):
        assert s.refresh()
    return a, b


def _lasting(server: RedisServer, limits: Limits) -> tuple[PoolStore, PoolStore]:
    """Two sidecars on a store past its grace long ago, with a TTL no refusal mark
    outlives in a test: what they decide does not depend on how fast it runs."""
    client = connect(server.address, None, timeout_s=0.5)
    client.set("kvq:{ns/pool}:epoch", 0)
    # A long wait for the others to lean: a charge returns as soon as they have.
    a, b = (PoolStore(client, "ns/pool", name, ttl_s=60.0, margin_blocks=4, take_back_s=10.0)
            for name in ("engine-a", "engine-b"))
    for s in (a, b):
        assert s.refresh({"acme": limits})
    return a, b


def _borrow(a: PoolStore, b: PoolStore, blocks: int) -> None:
    """a fills its split, is refused once (b claims its own split), b's refresh then
    lowers b's allowance to its margin, and a borrows the rest: `blocks` in all."""
    outcomes = [a.charge("acme", 10, LIMITS) for _ in range(6)]
    assert outcomes == [Outcome.LOCAL] * 5 + [Outcome.REFUSED]
    assert b.refresh()
    assert [a.charge("acme", 10, LIMITS) for _ in range(blocks // 10 - 5)] == [
        Outcome.POOL] * (blocks // 10 - 5)
    assert a.held("acme") == (blocks, blocks // 10)


def _refreshing(stores: tuple[PoolStore, ...], stop: threading.Event) -> list[threading.Thread]:
    def refresh(store: PoolStore) -> None:
        while not stop.wait(TTL_S / 3):
            store.refresh()

    return [threading.Thread(target=refresh, args=(s,)) for s in stores]


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_two_sidecars_keep_a_tenant_within_its_pool_wide_max(server: RedisServer) -> None:
    # Routing sends nearly all of the tenant to sidecar a: it borrows b's idle share
    # through the store, and the two together never pass maxBlocks nor maxRequests.
    a, b = _started(server)
    pool = _Pool()
    _run([threading.Thread(target=pool.burst, args=(a, random.Random(seed), 300, (3, 5, 8),
                                                    0.2, 20)) for seed in range(3)]
         + [threading.Thread(target=pool.burst, args=(b, random.Random(10), 300, (2,), 0.6,
                                                      20))])
    assert pool.peak_blocks <= LIMITS.max_blocks
    assert pool.peak_requests <= LIMITS.max_requests
    assert pool.peak_blocks > LIMITS.ceiling_blocks  # a used b's idle share
    assert pool.outcomes[Outcome.POOL] > 0 and pool.outcomes[Outcome.REFUSED] > 0
    assert a.held("acme") == (0, 0) == b.held("acme")


def test_a_store_restart_mid_burst_loses_no_charge(server: RedisServer) -> None:
    a, b = _started(server)
    _borrow(a, b, 70)  # a borrows beyond its split: 70 blocks, held across the restart
    server.kill()
    # Down: b keeps to what it had claimed (its ceiling less a's borrowing, at most),
    # and nothing beyond a's claim is admitted.
    assert a.charge("acme", 10, LIMITS) is Outcome.FALLBACK
    down = [b.charge("acme", 10, LIMITS) for _ in range(5)]
    assert Outcome.POOL not in down
    b_down = b.held("acme")[0]
    assert 70 + b_down <= LIMITS.max_blocks
    server.start()
    # Back, empty: the first scripts open a grace in which claims are republished and
    # nothing grows; after it, the store knows a's 70 and b's share again.
    assert a.refresh() and b.refresh()
    assert b.charge("acme", 40, LIMITS) in (Outcome.FALLBACK, Outcome.REFUSED)
    time.sleep(TTL_S)
    assert a.refresh() and b.refresh()
    assert b.charge("acme", LIMITS.max_blocks - 70 - b_down + 1, LIMITS) is Outcome.REFUSED
    assert a.charge("acme", LIMITS.max_blocks - 70 - b_down + 1, LIMITS) is Outcome.REFUSED
    a.release("acme", 70, 7)
    a.refresh()
    assert b.charge("acme", 45, LIMITS) is Outcome.POOL  # a's 70 gone, its split left


def test_a_dead_sidecars_charges_expire_within_its_ttl(server: RedisServer) -> None:
    a, b = _started(server)
    _borrow(a, b, 80)
    assert b.charge("acme", 25, LIMITS) is Outcome.REFUSED
    del a  # killed: it never refreshes nor releases again
    time.sleep(TTL_S + 0.1)
    assert b.charge("acme", 25, LIMITS) is Outcome.POOL


def test_a_store_killed_and_restarted_during_concurrent_bursts(server: RedisServer) -> None:
    # Bursts on both sidecars while each refreshes every third of its TTL, the store
    # killed and restarted empty in the middle: the tenant never passes maxBlocks.
    a, b = _started(server)
    _borrow(a, b, 70)  # held through the restart: the store must get it back
    pool, stop = _Pool(), threading.Event()
    pool.blocks, pool.requests = 70, 7

    def bursts(store: PoolStore, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            pool.burst(store, rng, 40, (3, 5, 8), 0.2 if store is a else 0.4)

    threads = _refreshing((a, b), stop)
    threads += [threading.Thread(target=bursts, args=(s, n)) for n, s in enumerate((a, a, b))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    server.kill()
    time.sleep(0.3)
    server.start()
    time.sleep(TTL_S + 0.4)
    stop.set()
    for t in threads:
        t.join(30)
    assert pool.peak_blocks <= LIMITS.max_blocks
    assert pool.outcomes[Outcome.FALLBACK] > 0
    assert a.held("acme") == (70, 7) and b.held("acme") == (0, 0)


def test_the_others_unused_allowances_are_taken_back_for_a_guaranteed_tenant(
    server: RedisServer,
) -> None:
    # Routing packs the tenant (pool-wide guarantee 80) onto a while b holds little of
    # its own split. The two allowances (50 each) fill maxBlocks, yet a request that what
    # the tenant holds leaves room for (20 + 60) is granted: b is asked to lean, its
    # allowance becomes what it holds (20), and a's charge is retried on the claims.
    # b's next admission then needs the store, and the two never pass maxBlocks.
    limits = Limits(max_blocks=100, ceiling_blocks=50, guaranteed_blocks=80)
    a, b = _lasting(server, limits)
    b.listen()
    assert b.subscribed.wait(10)
    try:
        assert [b.charge("acme", 10, limits) for _ in range(2)] == [Outcome.LOCAL] * 2
        assert [a.charge("acme", 10, limits) for _ in range(5)] == [Outcome.LOCAL] * 5
        # 50 + 50 claimed: without the take-back this was refused or passed maxBlocks.
        assert a.charge("acme", 10, limits) is Outcome.POOL  # held 20 + 60 <= 100
        assert a.take_backs == 1
        assert a.charge("acme", 10, limits) is Outcome.POOL  # claims 20 + 70 <= 100
        assert a.charge("acme", 10, limits) is Outcome.POOL  # claims 20 + 80 = maxBlocks
        assert a.charge("acme", 10, limits) is Outcome.REFUSED  # 20 + 90: beyond both
        assert b.charge("acme", 10, limits) is Outcome.REFUSED  # its allowance was taken
        assert b.refresh()  # under pressure: it may grow only within what a leaves
        assert b.charge("acme", 10, limits) is Outcome.REFUSED
        assert a.held("acme")[0] + b.held("acme")[0] == limits.max_blocks
    finally:
        b.close()


def test_a_sidecar_that_does_not_lean_in_time_keeps_its_claim(server: RedisServer) -> None:
    # b is alive but does not answer (not listening: slow, partitioned from the channel):
    # a's charge that what is held leaves room for waits its bounded time and is
    # refused, never granted above maxBlocks; b may still fill its allowance.
    limits = Limits(max_blocks=100, ceiling_blocks=50, guaranteed_blocks=80)
    a, b = _lasting(server, limits)
    a.take_back_s = 0.05
    assert [b.charge("acme", 10, limits) for _ in range(2)] == [Outcome.LOCAL] * 2
    assert [a.charge("acme", 10, limits) for _ in range(5)] == [Outcome.LOCAL] * 5
    assert a.charge("acme", 10, limits) is Outcome.REFUSED
    assert [b.charge("acme", 10, limits) for _ in range(3)] == [Outcome.LOCAL] * 3
    assert a.held("acme")[0] + b.held("acme")[0] == limits.max_blocks


def test_two_listening_sidecars_never_pass_max_with_the_guarantee_rule(
    server: RedisServer,
) -> None:
    # Concurrent bursts from threads on two sidecars sharing one Redis, the guarantee
    # rule active (guarantee 80 of maxBlocks 100, each split 50): charges that what is
    # held leaves room for take allowances back, and the tenant's total held never
    # passes maxBlocks (the rule that granted on the guarantee alone peaked at 112-121).
    limits = Limits(max_blocks=100, ceiling_blocks=50, guaranteed_blocks=80)
    a, b = _lasting(server, limits)
    for s in (a, b):
        s.take_back_s = 0.05
        s.listen()
        assert s.subscribed.wait(10)
    pool, stop = _Pool(), threading.Event()
    try:
        threads = _refreshing((a, b), stop)
        threads += [threading.Thread(target=pool.burst, args=(s, random.Random(n), 300,
                                                              (3, 5, 8), 0.3, 0, limits))
                    for n, s in enumerate((a, a, a, b))]
        for t in threads:
            t.start()
        for t in threads[2:]:
            t.join(60)
        stop.set()
        for t in threads[:2]:
            t.join(10)
    finally:
        a.close()
        b.close()
    assert pool.peak_blocks <= limits.max_blocks
    assert a.take_backs + b.take_backs > 0  # allowances were taken back
    assert pool.outcomes[Outcome.POOL] > 0 and pool.outcomes[Outcome.REFUSED] > 0


def test_a_release_under_pressure_reaches_the_others_next_charge_at_once(
    server: RedisServer,
) -> None:
    # b holds 50 and published it; a is refused (what is held, 50 + 60, passes
    # maxBlocks), which marks the tenant. Once b's refresh hears of the mark, b writes its
    # releases through: a's next charge is decided on what b holds now (10 + 70) and
    # granted, where the holdings b last published (40 + 70) refused it.
    limits = Limits(max_blocks=100, ceiling_blocks=50, guaranteed_blocks=80)
    a, b = _lasting(server, limits)
    assert [b.charge("acme", 10, limits) for _ in range(5)] == [Outcome.LOCAL] * 5
    assert b.refresh()  # the store sees b hold 50
    assert [a.charge("acme", 10, limits) for _ in range(5)] == [Outcome.LOCAL] * 5
    assert a.charge("acme", 10, limits) is Outcome.REFUSED  # 50 + 60 > 100
    assert not b.released("acme", 40, 4)  # not under pressure as b last heard: kept
    assert b.refresh()  # publishes 40, and b hears of the pressure
    assert a.charge("acme", 20, limits) is Outcome.REFUSED  # 40 + 70 > 100
    assert b.released("acme", 10, 1)  # written through
    b.listen()  # its unused allowance is taken back too
    assert b.subscribed.wait(10)
    try:
        assert a.charge("acme", 20, limits) is Outcome.POOL  # 10 + 70 <= 100
    finally:
        b.close()


def test_a_release_above_the_allowance_is_written_through_at_once(server: RedisServer) -> None:
    # a borrowed beyond its split through the store: b waits on a's claim, so a's
    # release reaches the store at once, not at a's next refresh.
    a, b = _started(server)
    _borrow(a, b, 80)
    assert b.charge("acme", 25, LIMITS) is Outcome.REFUSED
    assert a.released("acme", 60, 6)
    assert b.charge("acme", 25, LIMITS) is Outcome.POOL


def test_every_key_of_a_pool_lives_in_one_cluster_slot(tmp_path: Path) -> None:
    # On a Redis Cluster a script may only touch keys of one slot, on the node that owns
    # it. Every key the ledger writes (each sidecar's claims, the live set, the epoch,
    # the refusal marks) carries its pool as hash tag: one slot per pool, whatever the
    # sidecars' names, so each pool's scripts run whole on one node of a cluster.
    server = RedisServer(tmp_path, cluster=True)
    server.start()
    try:
        client = connect(server.address, None, timeout_s=0.5)
        stores = [PoolStore(client, pool, name, ttl_s=TTL_S, margin_blocks=4)
                  for pool in ("ns/pool", "other/pool") for name in ("engine-a", "pod-7")]
        for store in stores:
            assert store.refresh({"acme": LIMITS, "zeta": LIMITS})
        time.sleep(TTL_S)  # the new store's grace
        for store in stores:
            assert store.refresh()
        for store in stores:
            outcomes = {store.charge("acme", 10, LIMITS) for _ in range(8)}
            assert Outcome.REFUSED in outcomes  # a refusal mark was written too
            store.release("acme", 10)
            assert store.refresh()
        keys = [k.decode() for k in client.scan_iter(count=1000)]
        slots: dict[str, set[int]] = {}
        for key in keys:
            pool = key.split("{", 1)[1].split("}", 1)[0]
            slots.setdefault(pool, set()).add(
                int(client.execute_command("CLUSTER", "KEYSLOT", key)))
        assert len(keys) >= 2 * 5  # live, epoch, a mark and two sidecars' claims per pool
        assert all(len(s) == 1 for s in slots.values()), slots
        assert slots["ns/pool"] != slots["other/pool"]  # a cluster spreads the pools
    finally:
        server.kill()
