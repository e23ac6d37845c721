"""The session-affinity hint: a session's response names the engine that will hold its
lease, so a router can send the next turn there."""

from __future__ import annotations

import httpx

from engine_sidecar.policy import LeasePolicy

from .conftest import StubFactory
from .helpers import Keys, http_post, make_policy, tenant

HINT = "x-kvquota-lease-engine"


def _post(url: str, token: str, session: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if session is not None:
        headers["X-Session-Id"] = session
    return http_post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                     headers=headers, timeout=30)


def test_a_leased_session_is_told_which_engine_holds_it(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2")
    harness.apply(make_policy(
        tenant("acme", lease=LeasePolicy(seconds=60)),
        tenant("globex"),  # no leases: nothing is kept for its sessions
    ))
    acme, globex = keys.hs("acme"), keys.hs("globex")
    reply = _post(harness.url, acme, "chat-1")
    assert reply.status_code == 200
    assert reply.headers[HINT] == "vllm-pool-7f9c-2"
    assert HINT not in _post(harness.url, acme, None).headers  # no session, no lease
    assert HINT not in _post(harness.url, globex, "chat-2").headers


def test_without_an_engine_name_no_hint_is_sent(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, _ = stub_sidecar()
    harness.apply(make_policy(tenant("acme", lease=LeasePolicy(seconds=60))))
    reply = _post(harness.url, keys.hs("acme"), "chat-1")
    assert reply.status_code == 200 and HINT not in reply.headers
