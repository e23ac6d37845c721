"""The running sidecar keeps its pool-wide charges alive on a real Redis: its own task
(`PoolLink.run`, started with the app) republishes them three times per TTL, so a
charge held longer than the TTL stays counted, and is written down when it ends. It
signs in with the password from the store's own Secret, which neither its logs nor its
status show."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import redis

from engine_sidecar.contract.policy import PoolLimits, PoolStorePolicy
from tests.support.redis_server import RedisServer

from .conftest import StubFactory
from .helpers import WAIT, Keys, http_get, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

TTL_S = 0.5  # the least spec.poolStore.ttlSeconds allows
PASSWORD = "s3cret-of-the-pool-store"


def test_the_sidecar_refreshes_its_charges_ttl_while_a_request_holds_them(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer(tmp_path, password=PASSWORD)
    server.start()
    try:
        _refreshes_while_held(stub_sidecar, keys, server, tmp_path, caplog)
    finally:
        server.kill()


def _refreshes_while_held(stub_sidecar: StubFactory, keys: Keys, server: RedisServer,
                          tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store_secrets = tmp_path / "pool-store"
    store_secrets.mkdir()
    (store_secrets / "password").write_text(PASSWORD + "\n")
    caplog.set_level(logging.DEBUG)
    harness, stub = stub_sidecar(StubEngine(hold=threading.Event()), engine_id="engine-x",
                                 pool_store_secrets_dir=store_secrets)
    policy = harness.apply(make_policy(
        tenant("acme", max_blocks_per_engine=40, pool_wide=PoolLimits(guaranteed_blocks=40,
                                                           max_blocks=80)),
        pool_store=PoolStorePolicy(address=server.address, password_file="password",
                                   ttl_seconds=TTL_S, timeout_ms=200)))
    client = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
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
        status = http_get(harness.admin_url + "/kvquota/status", timeout=30)
        assert status.json()["poolStoreReachable"] is True
    finally:
        stub.release()
        request.join(30)
    wait_for(lambda: held() == 0, WAIT, "the ended request's charge was never written down")
    assert PASSWORD not in status.text and PASSWORD not in caplog.text
