"""The twin's pool-wide ledger decides as the real store's scripts do: the same random
sequence of charges, syncs and refreshes on two sidecars gives the same outcomes and
allowances on a real Redis and in the twin's table."""

from __future__ import annotations

import random
import time
from pathlib import Path

from engine_sidecar.gateway.pool_store import Limits, PoolStore, connect
from kvquota_lab.bench.pool_ledger import TwinLedger, TwinPoolStore
from tests.support.redis_server import RedisServer

LIMITS = Limits(max_blocks=120, ceiling_blocks=40, max_requests=10, ceiling_requests=4)


def test_the_twin_ledger_matches_the_store(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        real = [PoolStore(connect(server.address, None, timeout_s=0.5), "ns/p", f"e{i}",
                          ttl_s=1.0, margin_blocks=8) for i in range(3)]
        ledger = TwinLedger()
        twin = [TwinPoolStore(ledger, f"e{i}", margin_blocks=8) for i in range(3)]
        for store in real:
            store.refresh({"acme": LIMITS})
        time.sleep(1.0)  # the new store's grace: then allowances may grow
        for store in real:
            store.refresh()
        for tstore in twin:
            tstore.refresh({"acme": LIMITS})
        rng = random.Random(5)
        held = [0, 0, 0]
        outcomes = []
        for step in range(400):
            i = rng.randrange(3)
            if rng.random() < 0.1:
                real[i].refresh()
                twin[i].refresh()
            elif held[i] and rng.random() < 0.35:
                held[i] -= 1
                real[i].sync("acme", held[i] * 6, held[i])
                twin[i].sync("acme", held[i] * 6, held[i])
            else:
                a = real[i].charge("acme", 6, LIMITS)
                b = twin[i].charge("acme", 6, LIMITS)
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
    finally:
        server.kill()
