"""What the sidecar changes in the bodies it forwards on vLLM's other routes (a stub
engine that records them; the real engine's answers are in test_passthrough_routes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from .conftest import StubFactory
from .helpers import Keys, http_get, http_post, make_policy, tenant
from .stub_engine import StubEngine, read_body

CLIENT_OWNED = {"priority": -5, "cache_salt": "someone-elses", "request_id": "mine",
                "vllm_xargs": {"kvq_tenant": "other"}, "kv_transfer_params": {"x": 1}}


@dataclass
class RecordingEngine(StubEngine):
    """The stub engine, plus the bodies of the passthrough routes it was sent."""

    forwarded: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ("/v1/embeddings",
                                                            "/v1/responses"):
            await super().__call__(scope, receive, send)
            return
        body = await read_body(receive)
        self.forwarded.setdefault(scope["path"], []).append(json.loads(body))
        payload = b'{"object":"list","data":[]}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def recorded(stub_sidecar: StubFactory, keys: Keys) -> tuple[str, RecordingEngine, Any]:
    harness, stub = stub_sidecar(RecordingEngine())
    policy = harness.apply(make_policy(tenant("acme", priority=1, max_tokens=64,
                                              default_max_tokens=8)))
    assert isinstance(stub, RecordingEngine)
    return harness.url, stub, policy


def _post(url: str, path: str, body: dict[str, Any], keys: Keys) -> httpx.Response:
    return http_post(url + path, json=body, timeout=30,
                     headers={"Authorization": f"Bearer {keys.hs('acme')}"})


def test_the_tenants_fields_replace_the_clients(
    recorded: tuple[str, RecordingEngine, Any], keys: Keys,
) -> None:
    # /v1/responses is admitted: test_responses_admission covers its fields.
    url, stub, _policy = recorded
    path = "/v1/embeddings"
    response = _post(url, path, {"model": "m", "input": "hi", **CLIENT_OWNED}, keys)
    assert response.status_code == 200
    (sent,) = stub.forwarded[path]
    assert sent["priority"] == 1  # the tenant's, not the client's -5
    assert sent.get("cache_salt") != "someone-elses"
    assert "request_id" not in sent and "kv_transfer_params" not in sent
    assert sent.get("vllm_xargs", {"kvq_tenant": "acme"}) == {"kvq_tenant": "acme"}
    assert sent["input"] == "hi"


def test_responses_get_the_tenants_token_ceiling_and_default(
    recorded: tuple[str, RecordingEngine, Any], keys: Keys,
) -> None:
    url, stub, _policy = recorded
    assert _post(url, "/v1/responses", {"input": "a", "max_output_tokens": 10_000},
                 keys).status_code == 200
    assert _post(url, "/v1/responses", {"input": "b"}, keys).status_code == 200
    first, second = stub.forwarded["/v1/responses"]
    assert (first["max_output_tokens"], second["max_output_tokens"]) == (64, 8)


@pytest.mark.parametrize(("body", "message"), [
    ({"input": "a", "background": True}, "background"),
    ({"input": "a", "max_output_tokens": -1}, "max_output_tokens"),
    ([1, 2], "JSON object"),
])
def test_bad_bodies_are_refused_before_the_engine(
    recorded: tuple[str, RecordingEngine, Any], keys: Keys, body: Any, message: str,
) -> None:
    url, stub, _policy = recorded
    response = http_post(url + "/v1/responses", json=body, timeout=30,
                         headers={"Authorization": f"Bearer {keys.hs('acme')}"})
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert "/v1/responses" not in stub.forwarded


def test_credentials_are_checked_before_anything_is_forwarded(
    recorded: tuple[str, RecordingEngine, Any],
) -> None:
    url, stub, _policy = recorded
    for path in ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize"):
        assert http_post(url + path, json={"input": "a"}, timeout=30).status_code == 401
    assert stub.forwarded == {}
    assert http_get(url + "/health", timeout=30).status_code == 200  # probes need none
    assert http_get(url + "/v1/embeddings", timeout=30).status_code == 405
