"""The lab's one streamed-completion client (`kvquota_lab.stream_client`), against a
fake server: what the load generator, the engine bench and calibration read from it."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import httpx

from kvquota_lab.loadgen import complete
from kvquota_lab.stream_client import Target, completion_body, stream_completion


def _events(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


STREAM = _events(
    {"choices": [{"text": "", "token_ids": [5]}]},  # a token with no text of its own
    {"choices": [{"text": "", "token_ids": []}]},  # neither: not a token
    {"choices": [{"text": "b", "token_ids": [6, 7]}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}},
)


def _run(handler: Any, body: dict[str, Any], **kwargs: Any) -> Any:
    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_completion(client, "http://engine", body, **kwargs)
    return asyncio.run(go())


def test_a_stream_gives_ids_usage_queue_and_times_by_the_clock() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=STREAM, headers={
            "x-kvquota-queue-ms": "12", "server-timing": "admit;dur=1.5"})

    ticks = itertools.count()
    events: list[str] = []
    reply = _run(handler, completion_body("m", [1, 2, 3], 4),
                 headers=Target("http://engine", "m").request_headers("t", "s1"),
                 clock=lambda: float(next(ticks)),
                 on_answer=lambda: events.append("answer"),
                 on_first_token=lambda: events.append("token"))
    body = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/completions" and seen[0].headers["x-session-id"] == "s1"
    assert body["stream"] and body["return_token_ids"] and body["max_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True}
    assert reply.status == 200 and reply.token_ids == [5, 6, 7]
    # clock: sent 0, head 1, first token 2 (ids, no text), last 3, finish 4
    assert (reply.sent, reply.head, reply.first_token, reply.last_token, reply.finish) == \
        (0.0, 1.0, 2.0, 3.0, 4.0)
    assert reply.prompt_tokens == 3 and reply.cached_tokens == 2
    assert reply.queue_ms == 12.0 and reply.server_timing == ["admit;dur=1.5"]
    assert events == ["answer", "token"]


def test_no_usage_details_is_unknown_and_no_max_tokens_is_not_sent() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=_events({"choices": [{"text": "a"}]}))

    reply = _run(handler, completion_body("m", [1], None))
    assert "max_tokens" not in json.loads(seen[0].content)
    assert reply.first_token is not None and reply.token_ids == []  # text alone counts
    assert reply.prompt_tokens is None and reply.cached_tokens is None
    assert reply.queue_ms is None


def test_a_refusal_gives_its_code_and_retry_after() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": "TENANT_BLOCK_QUOTA"}},
                              headers={"retry-after": "2"})

    reply = _run(handler, completion_body("m", [1], 1))
    assert (reply.status, reply.code, reply.retry_after) == (429, "TENANT_BLOCK_QUOTA", 2.0)
    assert reply.first_token is None and reply.finish is not None


def test_a_transport_error_is_status_0_named_by_the_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    reply = _run(handler, completion_body("m", [1], 1))
    assert (reply.status, reply.code, reply.token_ids) == (0, "ConnectError", [])


def test_the_load_generator_measures_from_the_shared_client() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["max_tokens"] == 1:
            return httpx.Response(503, json={"error": {"code": "KV_CACHE_WATERMARK_EXCEEDED"}},
                                  headers={"retry-after": "soon"})
        return httpx.Response(200, content=STREAM, headers={"x-kvquota-queue-ms": "7"})

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = Target("http://engine", "m")
            return (await complete(client, target, "free", "t", [1, 2, 3], 4),
                    await complete(client, target, "free", "t", [1], 1))

    (ok, ids), (refused, none) = asyncio.run(go())
    assert ok.status == 200 and ids == [5, 6, 7] and ok.ttft is not None
    assert ok.total >= ok.ttft and ok.prompt_tokens == 3 and ok.cached_tokens == 2
    assert ok.queue_ms == 7.0 and ok.headers_after is not None
    assert refused.status == 503 and refused.code == "KV_CACHE_WATERMARK_EXCEEDED"
    assert refused.ttft is None and refused.retry_after is None and none == []
