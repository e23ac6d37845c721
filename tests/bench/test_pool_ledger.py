"""The twin's pool-wide ledger decides as the real store's scripts do: the same random
sequence of charges, syncs and refreshes on two sidecars gives the same outcomes and
allowances on a real Redis and in the twin's table."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from engine_sidecar.gateway.pool.store import Limits, Outcome, PoolStore, connect
from kvquota_lab.bench.pool_ledger import TwinLedger, TwinPoolStore
from tests.support.redis_server import RedisServer

LIMITS = Limits(max_blocks=120, ceiling_blocks=40, max_requests=10, ceiling_requests=4)
# Blocks only, with a pool-wide guarantee: the others' allowances are taken back when
# what is held leaves room (the concurrency limit above binds first and never gets there).
GUARANTEED = Limits(max_blocks=120, ceiling_blocks=40, guaranteed_blocks=90)


@pytest.mark.parametrize("limits", [LIMITS, GUARANTEED], ids=["requests", "guarantee"])
def test_the_twin_ledger_matches_the_store(tmp_path: Path, limits: Limits) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        client = connect(server.address, None, timeout_s=0.5)
        # A store past its grace long ago, and a TTL no refusal mark outlives here (the
        # twin's clock stands still): the outcomes do not depend on how fast this runs.
        client.set("kvq:{ns/p}:epoch", 0)
        real = [PoolStore(client, "ns/p", f"e{i}", ttl_s=60.0, margin_blocks=8,
                          take_back_s=10.0) for i in range(3)]
        for store in real:
            store.listen()  # the twin's sidecars all answer requests to lean
            assert store.subscribed.wait(10)
        ledger = TwinLedger()
        twin = [TwinPoolStore(ledger, f"e{i}", margin_blocks=8) for i in range(3)]
        for store in real:
            store.refresh({"acme": limits})
        for tstore in twin:
            tstore.refresh({"acme": limits})
        rng = random.Random(5)
        held = [0, 0, 0]
        outcomes = []
        written: set[bool] = set()
        asked_before = [0, 0, 0]  # the leans each real sidecar had answered
        guarantee_refusals = 0
        for step in range(400):
            i = rng.randrange(3)
            if rng.random() < 0.1:
                real[i].refresh()
                twin[i].refresh()
            elif held[i] and rng.random() < 0.35:
                held[i] -= 1
                if rng.random() < 0.5:  # a request ended: written through when it matters
                    wrote = real[i].released("acme", held[i] * 6, held[i])
                    assert wrote is twin[i].released("acme", held[i] * 6, held[i]), step
                    written.add(wrote)
                else:
                    real[i].sync("acme", held[i] * 6, held[i])
                    twin[i].sync("acme", held[i] * 6, held[i])
            else:
                # A borrower past the watermark asks whether its tenant is still within its
                # pool-wide guarantee (`PoolAdmission`): a round trip whatever the allowance.
                within = limits.guaranteed_blocks is not None and rng.random() < 0.2
                asked = real[i].take_backs
                a = real[i].charge("acme", 6, limits, within_guarantee=within)
                if real[i].take_backs > asked:  # every other sidecar leans before what follows
                    _answered(real, i, asked_before)
                    asked_before = [s.leans for s in real]
                b = twin[i].charge("acme", 6, limits, within_guarantee=within)
                guarantee_refusals += within and a is Outcome.REFUSED
                assert a is b, f"step {step}: store {a}, twin {b}"
                outcomes.append(a)
                if a.value in ("local", "pool"):
                    held[i] += 1
            if step % 40 == 0:
                for store in real:
                    store.refresh()
                for tstore in twin:
                    tstore.refresh()
        assert {o.value for o in outcomes} == {"local", "pool", "refused"}
        assert written == {True, False}
        if limits.guaranteed_blocks is not None:
            assert ledger.take_backs > 0 and sum(s.take_backs for s in real) == ledger.take_backs
            assert guarantee_refusals > 0
    finally:
        for store in real:
            store.close()
        server.kill()


def _answered(stores: list[PoolStore], asker: int, before: list[int]) -> None:
    """Wait until every sidecar but `asker` answered one more request to lean."""
    deadline = time.monotonic() + 10
    while any(s.leans <= before[n] for n, s in enumerate(stores) if n != asker):
        assert time.monotonic() < deadline, "a listening sidecar never answered"
        time.sleep(0.001)


def test_the_twin_takes_allowances_back_for_a_guaranteed_tenant() -> None:
    # As on the store: the engines' allowances (40 each) fill maxBlocks, yet the engine
    # routing packs the tenant onto is granted what its holdings leave room for: the
    # others lean to what they hold (20 and 0) and the claims then leave it room up to
    # maxBlocks, never beyond, whoever charges next.
    ledger = TwinLedger()
    twin = [TwinPoolStore(ledger, f"e{i}", margin_blocks=8) for i in range(3)]
    for tstore in twin:
        tstore.refresh({"acme": GUARANTEED})
    a, b, c = twin
    assert [b.charge("acme", 10, GUARANTEED) for _ in range(2)] == [Outcome.LOCAL] * 2
    assert [a.charge("acme", 10, GUARANTEED) for _ in range(4)] == [Outcome.LOCAL] * 4
    assert [a.charge("acme", 10, GUARANTEED) for _ in range(7)] == [
        Outcome.POOL] * 6 + [Outcome.REFUSED]  # 20 + 100 = maxBlocks
    assert ledger.take_backs == 1
    assert c.charge("acme", 10, GUARANTEED) is Outcome.REFUSED  # its allowance was taken
    b.refresh()
    c.refresh()  # under pressure: they grow only within what a leaves (nothing)
    assert b.charge("acme", 10, GUARANTEED) is Outcome.REFUSED
    assert c.charge("acme", 10, GUARANTEED) is Outcome.REFUSED
    assert sum(s.claims["acme"].blocks for s in twin) == GUARANTEED.max_blocks


def test_the_twin_writes_a_release_through_while_its_tenant_is_marked() -> None:
    # As on the store: b's requests end after a was refused for the tenant; once b has
    # heard of the mark its release is written at once, and a's next charge is decided
    # on what b holds now, not on what it last published.
    ledger = TwinLedger()
    a, b = TwinPoolStore(ledger, "a", margin_blocks=8), TwinPoolStore(ledger, "b", margin_blocks=8)
    limits = Limits(max_blocks=80, ceiling_blocks=40, guaranteed_blocks=60)
    for tstore in (a, b):
        tstore.refresh({"acme": limits})
    assert [b.charge("acme", 10, limits) for _ in range(4)] == [Outcome.LOCAL] * 4
    b.refresh()  # published: b holds 40
    assert [a.charge("acme", 10, limits) for _ in range(4)] == [Outcome.LOCAL] * 4
    assert a.charge("acme", 10, limits) is Outcome.REFUSED  # 40 + 50 > 80
    assert not b.released("acme", 30, 3)  # b has not heard of the mark: kept
    b.refresh()  # publishes 30, hears of the mark
    assert a.charge("acme", 20, limits) is Outcome.REFUSED  # 30 + 60 > 80
    assert b.released("acme", 0, 0)
    assert a.charge("acme", 20, limits) is Outcome.POOL  # 0 + 60 <= 80
