"""The sidecar in front of the real vLLM CPU engine (tiny model, scheduler plugin).

One engine and one sidecar per session; each test applies its own policy through the
sidecar's polled policy file, which the sidecar also writes for the plugin.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import EngineStats, SidecarStatus

from .conftest import Harness
from .helpers import (
    FULL_RESERVATION,
    WAIT,
    Keys,
    hs_forged_with,
    http_get,
    http_post,
    make_policy,
    rs_auth,
    tenant,
    unsigned_token,
    wait_for,
)

pytestmark = pytest.mark.engine

PROMPT = "tenant quota cache block lease premium"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _post(harness: Harness, body: dict[str, Any], token: str | None = None,
          path: str = "/v1/completions", **headers: str) -> httpx.Response:
    all_headers = {**(_bearer(token) if token else {}), **headers}
    return http_post(harness.url + path, json=body, headers=all_headers)


def _status(harness: Harness) -> SidecarStatus:
    response = http_get(harness.admin_url + "/kvquota/status")
    return SidecarStatus.model_validate_json(response.content)


def _engine_stats(engine: Any) -> EngineStats | None:
    try:
        return EngineStats.model_validate_json(engine.stats_path.read_bytes())
    except (OSError, ValueError):
        return None


def _wait_ledger_empty(harness: Harness, timeout: float = 30.0) -> None:
    harness.wait_ledger_empty(timeout)


@contextmanager
def _held_stream(harness: Harness, token: str, body: dict[str, Any]) -> Iterator[None]:
    """A streaming request that stays admitted until the block exits.

    The sidecar releases a reservation once it has relayed the engine's last byte, so
    the stream is held by a client that reads none of the body: the sidecar can relay
    only what the buffers between it and the client take (a 16 KiB send buffer, the
    server's 64 KiB write high-water mark, a 4 KiB receive buffer; Linux doubles the
    socket ones: about 0.2 MB at most). The stream's size must not hang on how fast the
    engine runs: vLLM merges the token deltas its server has not sent yet into one
    event, so a 2,000-token stream (0.52 MB, measured on an idle machine) shrinks when
    that server lags; without logprobs, 2 of 12 runs under 3 CPU hogs lost the hold.
    `logprobs: 20` adds about 460 bytes per token that merging keeps (0.93 MB for 2,000
    tokens, measured), so at least 4x the buffers wait for a reader that never comes.
    """
    small_window = httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    with httpx.Client(timeout=60, transport=small_window) as client, client.stream(
        "POST", harness.url + "/v1/completions", headers=_bearer(token),
        json={"prompt": PROMPT, "stream": True, "ignore_eos": True, "logprobs": 20, **body},
    ) as response:
        assert response.status_code == 200, response.read()
        yield  # admitted: the sidecar sends the status once the engine has accepted it


# ------------------------------------------------------------------ auth matrix

def _hs_policy() -> EnginePolicy:
    return make_policy(tenant("acme"), tenant("other-co"))


AUTH_CASES: list[tuple[str, Any, int]] = [
    ("valid", lambda k: _bearer(k.hs("acme")), 200),
    ("missing", lambda k: {}, 401),
    ("not bearer", lambda k: {"Authorization": "Basic YWxpY2U6cHc="}, 401),
    ("empty bearer", lambda k: {"Authorization": "Bearer"}, 401),
    ("not a JWT", lambda k: _bearer("not-a-jwt"), 401),
    ("truncated", lambda k: _bearer(k.hs("acme").rsplit(".", 1)[0]), 401),
    ("expired", lambda k: _bearer(k.hs("acme", exp=int(time.time()) - 60)), 401),
    ("not yet valid", lambda k: _bearer(k.hs("acme", nbf=int(time.time()) + 60)), 401),
    ("wrong audience", lambda k: _bearer(k.hs("acme", aud="another-service")), 401),
    ("wrong issuer", lambda k: _bearer(k.hs("acme", iss="https://evil.example")), 401),
    ("wrong key", lambda k: _bearer(hs_forged_with(b"k" * 32, k.claims("acme"))), 401),
    ("alg none", lambda k: _bearer(unsigned_token(k.claims("acme"))), 401),
    ("RS256 token, HS pool", lambda k: _bearer(k.rs("acme")), 401),
    ("unknown tenant", lambda k: _bearer(k.hs("stranger")), 403),
    ("no tenant claim", lambda k: _bearer(k.hs(None)), 403),
]


@pytest.mark.parametrize(("case", "headers", "status"), AUTH_CASES,
                         ids=[c[0] for c in AUTH_CASES])
def test_auth_matrix_hs256(sidecar: Harness, keys: Keys, case: str, headers: Any,
                           status: int) -> None:
    sidecar.apply(_hs_policy())
    sent = headers(keys)
    response = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, **sent)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["code"] == ("UNAUTHENTICATED" if status == 401 else "UNKNOWN_TENANT")
        assert keys.hs_secret.hex() not in response.text
        token = sent.get("Authorization", "").partition(" ")[2]
        assert len(token) < 16 or token not in response.text
    if status == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")


RS_CASES: list[tuple[str, Any, int]] = [
    ("valid RS256", lambda k: k.rs("acme"), 200),
    ("HS256 signed with the RSA public key",
     lambda k: hs_forged_with(k.rsa_public_pem(), k.claims("acme")), 401),
    ("another RSA key", lambda k: Keys(k.dir).rs("acme"), 401),
    ("ES256 token, RS pool", lambda k: k.es("acme"), 401),
    ("alg none", lambda k: unsigned_token(k.claims("acme")), 401),
]


@pytest.mark.parametrize(("case", "token", "status"), RS_CASES, ids=[c[0] for c in RS_CASES])
def test_auth_matrix_rs256(sidecar: Harness, keys: Keys, case: str, token: Any,
                           status: int) -> None:
    sidecar.apply(make_policy(tenant("acme"), auth=rs_auth()))
    response = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, token(keys))
    assert response.status_code == status, response.text


def test_anonymous_pool_and_trusted_header(sidecar: Harness, keys: Keys) -> None:
    sidecar.apply(make_policy(
        tenant("anon", tier="free", priority=2), tenant("gw-tenant"),
        auth={"jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"]},
              "anonymous": {"allowed": True, "tenant_id": "anon"},
              "trusted_tenant_header": "x-llm-d-inference-fairness-id"},
    ))
    assert _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    assert _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, "garbage").status_code == 401
    via_gateway = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1},
                        **{"x-llm-d-inference-fairness-id": "gw-tenant"})
    assert via_gateway.status_code == 200
    unknown = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1},
                    **{"x-llm-d-inference-fairness-id": "nobody"})
    assert unknown.status_code == 403
    counters = _status(sidecar).tenants
    assert counters["anon"].counters.admitted >= 1
    assert counters["gw-tenant"].counters.admitted >= 1


# ----------------------------------------------------------- clamping, prompts

def test_max_tokens_clamped_and_defaulted_as_vllm_reports(sidecar: Harness, keys: Keys) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=5, default_max_tokens=3)))
    token = keys.hs("acme")
    clamped = _post(sidecar, {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}, token)
    defaulted = _post(sidecar, {"prompt": PROMPT, "ignore_eos": True}, token)
    chat = _post(sidecar, {"messages": [{"role": "user", "content": PROMPT}],
                           "max_completion_tokens": 100, "ignore_eos": True}, token,
                 path="/v1/chat/completions")
    within = _post(sidecar, {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}, token)
    assert clamped.json()["usage"]["completion_tokens"] == 5
    assert defaulted.json()["usage"]["completion_tokens"] == 3
    assert chat.json()["usage"]["completion_tokens"] == 5
    assert within.json()["usage"]["completion_tokens"] == 2


def test_prompt_counts_match_vllm_and_limits_are_400(sidecar: Harness, keys: Keys) -> None:
    sidecar.apply(make_policy(tenant("acme")))
    token = keys.hs("acme")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    probe = _post(sidecar, {"messages": messages, "max_tokens": 1}, token,
                  path="/v1/chat/completions")
    exact = probe.json()["usage"]["prompt_tokens"]
    beyond_model = _post(sidecar, {"prompt": "quota " * 2100, "max_tokens": 1}, token)

    sidecar.apply(make_policy(tenant("acme", max_prompt_tokens=exact)))
    fits = _post(sidecar, {"messages": messages, "max_tokens": 1}, token,
                 path="/v1/chat/completions")
    longer = [*messages[:-1], {"role": "user", "content": PROMPT + " tenant"}]
    refused = _post(sidecar, {"messages": longer, "max_tokens": 1}, token,
                    path="/v1/chat/completions")

    assert fits.status_code == 200, fits.text
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "PROMPT_TOO_LONG"
    assert refused.json()["error"]["param"] == "messages"
    assert beyond_model.status_code == 400
    assert beyond_model.json()["error"]["code"] == "PROMPT_TOO_LONG"
    assert "2048" in beyond_model.json()["error"]["message"]


# --------------------------------------------------------------- 429 and 503

def test_concurrency_limit_is_429_while_a_stream_is_held(sidecar: Harness, keys: Keys) -> None:
    # maxQueueSeconds 0: refused at once. With a bound, the request would wait in the
    # sidecar's queue, and whether the held stream ends first would be a race.
    sidecar.apply(make_policy(tenant("acme", max_tokens=2000, max_concurrent_requests=1,
                                     max_queue_seconds=0)))
    token = keys.hs("acme")
    with _held_stream(sidecar, token, {"max_tokens": 2000}):
        held = _status(sidecar).tenants["acme"].usage
        refused = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, token)
    assert held.inflight == 1, held
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "TENANT_CONCURRENCY_EXHAUSTED"
    assert int(refused.headers["retry-after"]) >= 1
    _wait_ledger_empty(sidecar)
    assert _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, token).status_code == 200


def test_block_quota_is_429_while_a_stream_is_held(sidecar: Harness, keys: Keys) -> None:
    # ceil((6 + 2000) / 32) = 63 blocks held; another 63 would exceed 100.
    # maxQueueSeconds 0: refused at once (see the concurrency test above).
    # aboveMax Never: a hard ceiling (the engine's idle KV would take it otherwise).
    sidecar.apply(make_policy(tenant("acme", max_tokens=2000, max_blocks_per_engine=100,
                                     max_queue_seconds=0, above_max="Never"),
                              reservation=FULL_RESERVATION))
    token = keys.hs("acme")
    with _held_stream(sidecar, token, {"max_tokens": 2000}):
        held = _status(sidecar).tenants["acme"].usage
        refused = _post(sidecar, {"prompt": PROMPT, "max_tokens": 2000}, token)
        small = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, token)
    assert (held.reserved_blocks, held.inflight) == (63, 1)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "TENANT_BLOCK_QUOTA_EXHAUSTED"
    assert "retry-after" in refused.headers
    assert small.status_code == 200  # 63 + 1 fits
    _wait_ledger_empty(sidecar)
    status = _status(sidecar).tenants["acme"]
    assert status.counters.rejected_quota >= 1 and status.usage.reserved_blocks == 0


def test_a_capped_tenant_runs_beyond_max_blocks_in_kv_nobody_else_wants(
    sidecar: Harness, keys: Keys
) -> None:
    # The same two requests with aboveMax Reclaimable (the default): the engine's KV is
    # idle and nobody else waits for it, so the second runs beyond maxBlocks and the
    # status shows the blocks charged above it. A tenant of its own (see below).
    sidecar.apply(make_policy(tenant("capped", max_tokens=2000, max_blocks_per_engine=100,
                                     max_queue_seconds=0), reservation=FULL_RESERVATION))
    token = keys.hs("capped")
    with (_held_stream(sidecar, token, {"max_tokens": 2000}),
          _held_stream(sidecar, token, {"max_tokens": 2000})):
        usage = _status(sidecar).tenants["capped"].usage
    assert (usage.inflight, usage.charged_blocks, usage.above_max_blocks) == (2, 126, 26)
    _wait_ledger_empty(sidecar)
    assert _status(sidecar).tenants["capped"].usage.above_max_blocks == 0


def test_an_estimated_reservation_admits_what_max_tokens_refused(
    sidecar: Harness, keys: Keys
) -> None:
    # The same two requests as above, reserved at an output estimate instead of
    # max_tokens: one block each, both admitted at once. A tenant of its own: the
    # stream the test above left can still hold its 63 blocks in the engine (vLLM
    # aborts it a step after the sidecar's ledger let it go, later on a busy machine),
    # and a tenant is charged the blocks its running requests hold.
    sidecar.apply(make_policy(tenant("estimated", max_tokens=2000, max_blocks_per_engine=100,
                                     max_queue_seconds=0)))
    token = keys.hs("estimated")
    with _held_stream(sidecar, token, {"max_tokens": 2000}):
        held = _status(sidecar).tenants["estimated"].usage
        # Admitted and streaming; the client then leaves, so the engine stops decoding.
        with httpx.stream("POST", sidecar.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 2000, "stream": True},
                          headers=_bearer(token)) as second:
            assert second.status_code == 200
            assert next(second.iter_lines()).startswith("data: ")
    # The tier's default of 8 tokens, or shorter answers the session's sidecar learned
    # from the tenant's earlier requests: one block either way, plus the blocks the
    # tokens it has relayed so far fill (its charge follows what it decodes): far below
    # the 63 its max_tokens would reserve.
    assert held.inflight == 1 and 1 <= held.reserved_blocks < 63
    assert 1 <= held.output_estimate_tokens <= 8
    _wait_ledger_empty(sidecar)


def test_watermark_bounds_borrowers_never_guaranteed_tenants(
    sidecar: Harness, keys: Keys
) -> None:
    # 100 blocks, 20 kept free. Two prompts x ceil((6 + 1300) / 32) = 82 blocks: more
    # than a borrower can ever get (80), so a 400 at once rather than a 503 to retry
    # (the 503 for what would fit an emptier engine: test_admission, test_queueing).
    sidecar.apply(make_policy(
        tenant("free", tier="free", priority=2, guaranteed_blocks=0, max_tokens=1300),
        tenant("premium", tier="premium", priority=0, guaranteed_blocks=90, max_tokens=1300),
        capacity_blocks=100, watermark=0.2, reservation=FULL_RESERVATION,
    ))
    big = {"prompt": [PROMPT, PROMPT + " pool"], "max_tokens": 1300, "stream": True}
    borrower = _post(sidecar, big, keys.hs("free"))
    small = _post(sidecar, {"prompt": PROMPT, "max_tokens": 1}, keys.hs("free"))
    with httpx.stream("POST", sidecar.url + "/v1/completions", json=big,
                      headers=_bearer(keys.hs("premium")), timeout=60) as guaranteed:
        assert guaranteed.status_code == 200
        lines = guaranteed.iter_lines()
        assert next(lines).startswith("data: ")  # admitted and streaming; then disconnect

    assert borrower.status_code == 400, borrower.text
    assert borrower.json()["error"]["code"] == "REQUEST_EXCEEDS_ENGINE_CAPACITY"
    assert "at most the 80 of the engine's 100 blocks" in borrower.json()["error"]["message"]
    assert "retry-after" not in borrower.headers
    assert small.status_code == 200
    status = _status(sidecar)
    assert status.capacity_source == "policy" and status.total_blocks == 100
    assert status.tenants["free"].counters.rejected_watermark >= 1
    _wait_ledger_empty(sidecar)


# ------------------------------------------------------------------ streaming

def _events(response: httpx.Response) -> list[dict[str, Any] | str]:
    events: list[dict[str, Any] | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streaming_passes_through_like_vllm(sidecar: Harness, engine: Any, keys: Keys) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=64)))
    body = {"model": str(engine.model), "prompt": PROMPT, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as direct:
        direct_events = _events(direct)
    with httpx.stream("POST", sidecar.url + "/v1/completions", json=body, timeout=60,
                      headers=_bearer(keys.hs("acme"))) as proxied:
        proxied_type = proxied.headers["content-type"]
        proxied_events = _events(proxied)

    def text(events: list[Any]) -> str:
        return "".join(c["text"] for e in events if isinstance(e, dict)
                       for c in e.get("choices", []))

    def shapes(events: list[Any]) -> set[tuple[str, ...]]:
        return {tuple(sorted(e)) for e in events if isinstance(e, dict)}

    # Not the number of events: vLLM merges the token deltas its server has not sent
    # yet into one event, so how many a stream has depends on how busy the machine is
    # (13 or 11 against 14 were seen at load 6). What is relayed must be the same.
    assert proxied_type == direct.headers["content-type"]
    assert proxied_events[-1] == "[DONE]"
    assert text(proxied_events) == text(direct_events)
    assert proxied_events[-2]["usage"] == direct_events[-2]["usage"]  # type: ignore[index]
    assert shapes(proxied_events) == shapes(direct_events)


async def test_disconnect_storm_leaves_the_ledger_at_zero(
    sidecar: Harness, engine: Any, keys: Keys
) -> None:
    # Within their guarantees: the watermark never refuses them, only cancellations end them.
    sidecar.apply(make_policy(tenant("acme", max_tokens=400, guaranteed_blocks=5000),
                              tenant("beta", max_tokens=400, guaranteed_blocks=5000)))
    tokens = {"acme": keys.hs("acme"), "beta": keys.hs("beta")}
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    errors: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        tenant_id = "acme" if i % 2 else "beta"
        chat = i % 3 == 0
        body: dict[str, Any] = {"max_tokens": 400, "ignore_eos": True, "stream": i % 5 != 0}
        if chat:
            body["messages"] = [{"role": "user", "content": f"{PROMPT} {i}"}]
        else:
            body["prompt"] = f"{PROMPT} {i}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        mode = rng.choice(["before_headers", "after_first", "after_some", "complete"])
        kind = mode
        try:
            async with asyncio.timeout(rng.uniform(0.001, 0.3) if mode == "before_headers"
                                       else 120):
                async with client.stream("POST", sidecar.url + path, json=body,
                                         headers=_bearer(tokens[tenant_id])) as response:
                    if response.status_code != 200:
                        kind = f"status_{response.status_code}"
                        errors.append((await response.aread()).decode()[:300])
                        return
                    lines = 0
                    async for _line in response.aiter_lines():
                        lines += 1
                        if mode == "after_first" or (mode == "after_some" and lines > 6):
                            return  # leaving the block closes the connection mid-stream
        except TimeoutError:
            kind = "timed_out"
        finally:
            outcomes[kind] = outcomes.get(kind, 0) + 1

    limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(300)))

    assert not errors, (outcomes, errors[:3])
    await asyncio.to_thread(_wait_ledger_empty, sidecar, 60)
    status = _status(sidecar)
    assert all(t.usage.inflight == 0 and t.usage.reserved_blocks == 0
               for t in status.tenants.values())

    def engine_idle() -> bool:  # the engine aborted what the clients abandoned
        stats = _engine_stats(engine)
        return stats is not None and all(
            t.running == 0 and t.waiting == 0 for t in stats.tenants.values())

    # Not asserted here: that some reservation ended "cancelled". Whether a client leaves
    # before the engine finishes depends on the machine: beside two busy loops, all 224
    # admitted requests of a storm completed once, and vLLM itself, asked directly, ran
    # an abandoned 1,800-token request to its end in 2 of 3 runs (its API server, which
    # sends the abort, is starved). test_gateway_logic checks the sidecar's part.
    await asyncio.to_thread(wait_for, engine_idle, 60, "engine still busy after the storm")


# ------------------------------------------------------ what the engine received

def test_client_tags_are_overwritten_as_the_engine_sees_them(
    sidecar: Harness, engine: Any, keys: Keys
) -> None:
    sidecar.apply(make_policy(tenant("acme", tier="premium", priority=0, max_tokens=4),
                              tenant("beta", max_tokens=4)))
    prompt = " ".join(["tenant quota cache block lease premium standard free"] * 24)
    spoof = {"priority": -1000, "cache_salt": "attacker-salt",
             "vllm_xargs": {"kvq_tenant": "beta", "kvq_session": "victim"}}

    def hits(tenant_id: str) -> int:
        stats = _engine_stats(engine)
        tenant_stats = stats.tenants.get(tenant_id) if stats else None
        return tenant_stats.prefix_hit_tokens if tenant_stats else 0

    def prompt_tokens(tenant_id: str) -> int:
        stats = _engine_stats(engine)
        tenant_stats = stats.tenants.get(tenant_id) if stats else None
        return tenant_stats.prompt_tokens if tenant_stats else 0

    before = {t: (hits(t), prompt_tokens(t)) for t in ("acme", "beta")}
    first = _post(sidecar, {"prompt": prompt, "max_tokens": 1, **spoof}, keys.hs("acme"))
    second = _post(sidecar, {"prompt": prompt, "max_tokens": 1,
                             **spoof, "cache_salt": "another-salt"}, keys.hs("acme"))
    assert first.status_code == second.status_code == 200, first.text
    n_prompt = first.json()["usage"]["prompt_tokens"]
    # The plugin attributes both to acme (the sidecar's tenant), not to the spoofed beta,
    # and the second is a prefix-cache hit: the client salts were replaced by acme's.
    wait_for(lambda: prompt_tokens("acme") >= before["acme"][1] + 2 * n_prompt, WAIT,
             "plugin never attributed the requests to acme")
    assert prompt_tokens("beta") == before["beta"][1]
    assert hits("acme") - before["acme"][0] >= n_prompt - engine.block_size

    # beta sends the same prompt with acme's would-be tags: no cross-tenant hit.
    third = _post(sidecar, {"prompt": prompt, "max_tokens": 1,
                            "vllm_xargs": {"kvq_tenant": "acme"}}, keys.hs("beta"))
    assert third.status_code == 200
    wait_for(lambda: prompt_tokens("beta") >= before["beta"][1] + n_prompt, WAIT,
             "plugin never saw beta's request")
    assert hits("beta") == before["beta"][0]


# ------------------------------------------------------------------ hot reload

def test_hot_reload_changes_a_limit_without_restart(
    sidecar: Harness, engine: Any, keys: Keys
) -> None:
    token = keys.hs("acme")
    body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
    first = sidecar.apply(make_policy(tenant("acme", max_tokens=4)))
    before = _post(sidecar, body, token).json()["usage"]["completion_tokens"]
    second = sidecar.apply(make_policy(tenant("acme", max_tokens=9)))
    after = _post(sidecar, body, token).json()["usage"]["completion_tokens"]

    assert (before, after) == (4, 9)
    assert first.version != second.version
    assert _status(sidecar).policy_version == second.version
    assert EnginePolicy.from_json(engine.policy_path.read_text()).version == second.version
    wait_for(lambda: (s := _engine_stats(engine)) is not None
             and s.policy_version == second.version, 10, "plugin did not load the policy")
    metrics = http_get(sidecar.admin_url + "/metrics").text
    assert f'version="{second.version}"' in metrics and f'version="{first.version}"' not in metrics
