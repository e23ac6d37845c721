"""vLLM started with `--api-key`: the sidecar sends vLLM's key, never the tenant's token.

Against the stub engine, which records the headers of every call: the session's real
engine runs without a key, and a second engine with one would have to run beside it on
a 2-core machine (the suite runs one engine at a time). vLLM's own check is simple and
read from its source: `AuthenticationMiddleware` (vllm/entrypoints/serve/middleware/
authenticate.py) compares `Authorization: Bearer <key>` on /v1, /v2, /inference paths
and answers 401 otherwise; the stub does the same, and records every call's headers.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.types import Receive, Scope, Send

from engine_sidecar.gateway.auth.engine_key import EngineKey, load_engine_key
from kvquota.cli import build_parser

from .conftest import Harness, StubFactory
from .helpers import Keys, http_get, http_post, make_policy, tenant
from .stub_engine import StubEngine, read_body

ANSWERS: dict[str, Any] = {
    "/v1/responses": {"id": "resp_1", "object": "response", "status": "completed",
                      "output": [], "usage": {"input_tokens": 1, "output_tokens": 1,
                                              "total_tokens": 2}},
    "/v1/embeddings": {"object": "list", "model": "stub-model",
                       "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                       "usage": {"prompt_tokens": 1, "total_tokens": 1}},
    "/metrics": {},
}


@dataclass
class KeyedEngine(StubEngine):
    """The stub engine behind vLLM's API-key check, recording every call's headers."""

    key: str = ""
    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"]}
        self.calls.append((scope["path"], headers))
        guarded = scope["path"].startswith(("/v1", "/v2", "/inference"))
        if guarded and headers.get("authorization") != f"Bearer {self.key}":
            await read_body(receive)
            await _send(send, 401, {"error": "Unauthorized"})
        elif scope["path"] in ANSWERS:
            await read_body(receive)
            await _send(send, 200, ANSWERS[scope["path"]])
        else:
            await super().__call__(scope, receive, send)


async def _send(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def engine_key() -> str:
    return secrets.token_urlsafe(24)


def _harness(stub_sidecar: StubFactory, key: str, sidecar_key: str | None
             ) -> tuple[Harness, KeyedEngine]:
    engine = KeyedEngine(key=key)
    harness, _ = stub_sidecar(engine, engine_key=EngineKey(sidecar_key) if sidecar_key
                              else None)
    harness.apply(make_policy(tenant("acme")))
    return harness, engine


def test_every_engine_call_carries_vllms_key_and_no_tenant_token(
    stub_sidecar: StubFactory, keys: Keys, engine_key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    harness, engine = _harness(stub_sidecar, engine_key, engine_key)
    token = keys.hs("acme")
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=token, max_retries=0,
                           timeout=30)
    client.completions.create(model="tiny", prompt="tenant quota", max_tokens=2)
    client.chat.completions.create(model="tiny", max_tokens=2,
                                   messages=[{"role": "user", "content": "tenant quota"}])
    client.responses.create(model="tiny", input="tenant quota", max_output_tokens=2)
    client.models.list()
    client.embeddings.create(model="tiny", input="tenant quota", encoding_format="float")
    bearer = {"Authorization": f"Bearer {token}"}
    assert http_post(harness.url + "/tokenize", json={"prompt": "a"}, headers=bearer,
                     timeout=30).status_code == 200
    assert http_get(harness.url + "/metrics", timeout=30).status_code == 200

    paths = {path for path, _ in engine.calls}
    assert {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions",
            "/v1/responses", "/v1/embeddings", "/tokenize", "/metrics"} <= paths
    for path, headers in engine.calls:
        assert headers.get("authorization") == f"Bearer {engine_key}", path
        assert token not in json.dumps(headers), path
    logged = caplog.text
    assert engine_key not in logged and token not in logged
    assert engine_key not in repr(harness.gateway.config)


@pytest.mark.parametrize("sidecar_has_key", [True, False])
def test_an_engine_that_refuses_the_sidecar_is_a_clear_502(
    stub_sidecar: StubFactory, keys: Keys, engine_key: str, sidecar_has_key: bool,
) -> None:
    wrong = secrets.token_urlsafe(24) if sidecar_has_key else None
    harness, _engine = _harness(stub_sidecar, engine_key, wrong)
    token = keys.hs("acme")
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=token, max_retries=0,
                           timeout=30)
    for call in (lambda: client.completions.create(model="tiny", prompt="a",
                                                   max_tokens=2),
                 lambda: client.chat.completions.create(
                     model="tiny", max_tokens=2,
                     messages=[{"role": "user", "content": "a"}]),
                 lambda: client.embeddings.create(model="tiny", input="a",
                                                  encoding_format="float")):
        with pytest.raises(openai.APIStatusError) as refused:
            call()
        assert refused.value.status_code == 502  # not 401: the tenant's token was fine
        message = json.dumps(refused.value.body)
        assert "API key" in message and "--engine-api-key-file" in message
        assert engine_key not in message and token not in message
        if wrong:
            assert wrong not in message
    assert harness.ledger_is_empty()


def test_the_key_comes_from_a_file_or_vllms_own_variable(tmp_path: Path) -> None:
    key_file = tmp_path / "vllm-api-key"
    key_file.write_text("key-from-file\n")  # a text secret's newline is not the key's
    from_file = load_engine_key(key_file, {})
    assert from_file is not None and from_file.header == b"Bearer key-from-file"
    by_env = load_engine_key(None, {"KVQUOTA_ENGINE_API_KEY_FILE": str(key_file),
                                    "VLLM_API_KEY": "ignored"})
    assert by_env is not None and by_env.header == b"Bearer key-from-file"
    from_vllm = load_engine_key(None, {"VLLM_API_KEY": "key-from-env"})
    assert from_vllm is not None and from_vllm.header == b"Bearer key-from-env"
    assert "key-from-env" not in repr(from_vllm)
    assert load_engine_key(None, {}) is None
    with pytest.raises(SystemExit, match="cannot be read"):
        load_engine_key(tmp_path / "missing", {})
    (tmp_path / "blank").write_text("\n")
    with pytest.raises(SystemExit, match="non-empty line") as blank:
        load_engine_key(tmp_path / "blank", {})
    assert "key-from" not in str(blank.value)


def test_kvquota_sidecar_takes_the_key_file_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["sidecar", "--policy-file", str(tmp_path / "p.json"),
                                      "--engine-api-key-file", str(tmp_path / "key")])
    assert args.engine_api_key_file == tmp_path / "key"
