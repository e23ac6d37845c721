"""The running sidecar keeps its pool-wide charges alive on a real Redis: its own task
(`PoolLink.run`, started with the app) republishes them three times per TTL, so a
charge held longer than the TTL stays counted, and is written down when it ends."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis

from engine_sidecar.contract.policy import PoolLimits, PoolStorePolicy
from tests.support.redis_server import RedisServer

from .conftest import StubFactory
from .helpers import WAIT, Keys, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

TTL_S = 0.5  # the least spec.poolStore.ttlSeconds allows


def test_the_sidecar_refreshes_its_charges_ttl_while_a_request_holds_them(
    stub_sidecar: StubFactory, keys: Keys, server: RedisServer, tmp_path: Path,
) -> None:
    harness, stub = stub_sidecar(StubEngine(hold=threading.Event()), engine_id="engine-x")
    policy = harness.apply(make_policy(
        tenant("acme", max_blocks_per_engine=40, pool_wide=PoolLimits(guaranteed_blocks=40,
                                                           max_blocks=80)),
        pool_store=PoolStorePolicy(address=server.address, ttl_seconds=TTL_S,
                                   timeout_ms=200)))
    client = redis.Redis(host="127.0.0.1", port=server.port)
    key = f"kvq:{{{policy.pool}}}:c:engine-x"

    def held() -> int:
        value = client.hget(key, "b:acme")
        return int(value) if value is not None else -1

    token = keys.hs("acme")
    request = threading.Thread(target=lambda: http_post(
        harness.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {token}"}, timeout=60), daemon=True)
    request.start()
    try:
        wait_for(lambda: stub.active == 1, WAIT, "the request never reached the engine")
        wait_for(lambda: held() > 0, WAIT, "the sidecar never published its charge")
        # Four TTLs with the request still held: without the sidecar's refreshes the
        # key would have expired within the first.
        deadline = time.monotonic() + 4 * TTL_S
        while time.monotonic() < deadline:
            assert held() > 0, "the charge expired while its request ran"
            assert client.zscore(f"kvq:{{{policy.pool}}}:live", "engine-x") is not None
            time.sleep(TTL_S / 10)
    finally:
        stub.release()
        request.join(30)
    wait_for(lambda: held() == 0, WAIT, "the ended request's charge was never written down")
