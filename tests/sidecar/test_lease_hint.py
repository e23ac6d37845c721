"""The session-affinity hint: a session's response names the engine that will hold its
lease, so a router can send the next turn there."""

from __future__ import annotations

import base64

import httpx

from engine_sidecar.contract.policy import LeasePolicy
from engine_sidecar.gateway.admission.call_back import calls_back
from engine_sidecar.gateway.admission.rules import PoolView, _TenantView

from .conftest import StubFactory
from .helpers import FULL_RESERVATION, Keys, http_post, make_policy, tenant

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
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2", engine_namespace=None)
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


# The endpoint picker's rule, as llm-d's session-affinity-scorer applies it
# (llm-d/llm-d-inference-scheduler, pkg/plugins/scorer/session_affinity.go): the
# session token, from the `x-session-token` header (or, in the cookie version, the
# `llm-d-session` cookie), is base64.StdEncoding of the pod's "<namespace>/<name>";
# that pod scores 1, every other 0.
def _picked(token: str | None, pods: list[str]) -> dict[str, float]:
    target = ""
    if token:
        try:
            target = base64.b64decode(token, validate=True).decode()
        except ValueError:
            target = ""
    return {pod: 1.0 if pod == target else 0.0 for pod in pods}


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


POOL = ["inference/vllm-pool-7f9c-1", "inference/vllm-pool-7f9c-2"]


def test_a_picker_sends_a_leased_sessions_next_turn_back_to_its_pod(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2", engine_namespace="inference")
    harness.apply(make_policy(tenant("acme", lease=LeasePolicy(seconds=60))))
    headers = {"Authorization": f"Bearer {keys.hs('acme')}", "X-Session-Id": "chat-1"}
    body = {"prompt": "x", "max_tokens": 1, "stream": True}
    with httpx.Client(base_url=harness.url, timeout=30) as client:  # keeps cookies
        first = client.post("/v1/completions", json=body, headers=headers)
        second = client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == second.status_code == 200
    # A client that echoes the header: the picker scores the lease's pod, only it.
    echoed = first.headers["x-session-token"]
    assert _picked(echoed, POOL) == {POOL[0]: 0.0, POOL[1]: 1.0}
    # A client that keeps cookies sends the cookie version of the same token unasked.
    sent = _cookie(second.request.headers["cookie"], "llm-d-session")
    assert sent == echoed and _picked(sent, POOL)[POOL[1]] == 1.0
    assert first.headers[HINT] == "vllm-pool-7f9c-2"  # the plain hint stays


def test_only_a_leased_session_is_pinned_to_its_pod(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """Work that leaves nothing pinned behind is left to the picker's other scorers."""
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2", engine_namespace="inference")
    harness.apply(make_policy(tenant("acme", lease=LeasePolicy(seconds=60)),
                              tenant("globex")))
    for reply in (_post(harness.url, keys.hs("acme"), None),
                  _post(harness.url, keys.hs("globex"), "chat-2")):
        assert reply.status_code == 200
        assert "x-session-token" not in reply.headers
        assert "llm-d-session" not in reply.headers.get("set-cookie", "")


def test_without_its_namespace_the_engine_cannot_be_named_to_a_picker(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2", engine_namespace=None)
    harness.apply(make_policy(tenant("acme", lease=LeasePolicy(seconds=60))))
    reply = _post(harness.url, keys.hs("acme"), "chat-1")
    assert reply.headers[HINT] == "vllm-pool-7f9c-2"
    assert "x-session-token" not in reply.headers and "set-cookie" not in reply.headers


# Full reservations: each turn reserves ceil((prompt + 2000) / 32) = 63 blocks.
TURN = {"prompt": "x", "max_tokens": 2000}


def test_an_engine_without_room_for_another_turn_stops_calling_the_session_back(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """With its tenant's charge here (this turn's 63 blocks) leaving less than another
    turn below its maxBlocks, the response clears the session token: a client that
    echoes the header names no pod, one that keeps cookies drops the cookie, so the
    picker's load scorers place the next turn. A tenant with room for it keeps it."""
    harness, _ = stub_sidecar(engine_id="vllm-pool-7f9c-2", engine_namespace="inference")
    lease = LeasePolicy(seconds=60)
    harness.apply(make_policy(
        tenant("acme", lease=lease, max_tokens=2000, max_blocks_per_engine=125),  # 62 left after
        tenant("globex", lease=lease, max_tokens=2000, max_blocks_per_engine=126),  # 63 left
        reservation=FULL_RESERVATION))
    pod_token = base64.b64encode(POOL[1].encode()).decode()
    replies = {}
    for tenant_id in ("acme", "globex"):
        with httpx.Client(base_url=harness.url, timeout=30) as client:
            # The cookie the last turn left, naming this pod, as the client keeps it.
            client.cookies.set("llm-d-session", pod_token, domain=httpx.URL(harness.url).host)
            reply = client.post("/v1/completions", json=TURN, headers={
                "Authorization": f"Bearer {keys.hs(tenant_id)}", "X-Session-Id": "chat-1"})
            assert reply.status_code == 200
            replies[tenant_id] = (reply, client.cookies.get("llm-d-session"))
    full, kept = replies["acme"]
    assert _picked(full.headers["x-session-token"], POOL) == {POOL[0]: 0.0, POOL[1]: 0.0}
    assert kept is None  # the cookie expired: the next turn carries none
    assert full.headers[HINT] == "vllm-pool-7f9c-2"  # where the KV is, still
    roomy, kept = replies["globex"]
    assert roomy.headers["x-session-token"] == kept == pod_token
    assert _picked(kept, POOL)[POOL[1]] == 1.0


def test_sessions_already_called_back_take_their_room_first() -> None:
    """Each token promises the session room for its next turn: with another session of
    the tenant between turns here (its lease pins 60 blocks, its next turn is at least
    that), this session is called back only if both next turns fit below maxBlocks."""
    def view(leases: dict[str, int]) -> PoolView:
        acme = _TenantView(reserved=63, inflight=1, held=63 + sum(leases.values()),
                           pinned=sum(leases.values()), lease_only=sum(leases.values()),
                           pinned_in_use=0, growth=0, leases=leases,
                           sessions=frozenset({"chat-1"}))
        return PoolView(total_blocks=1000, free_blocks=800, source="engine",
                        tenants={"acme": acme})

    waiting = {"chat-2": 60}  # chat-1 is in flight: its own lease is not counted twice
    assert calls_back(view({**waiting, "chat-1": 40}), "acme", "chat-1", 63, 186)
    assert not calls_back(view({**waiting, "chat-1": 40}), "acme", "chat-1", 63, 185)
    assert calls_back(view({"chat-1": 40}), "acme", "chat-1", 63, 126)  # alone: 63 + 63
