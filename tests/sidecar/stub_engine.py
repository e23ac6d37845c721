"""A tiny stand-in for vLLM's HTTP surface that records what it received.

Used for logic tests (in process) and for the narrow assertion "what exactly did the
engine receive"; the contract tests against the real engine show vLLM accepts it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive, Scope, Send

MAX_MODEL_LEN = 2048
# vLLM's own scrape, in the shape vLLM serves it (two of its series).
VLLM_METRICS = (
    b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{engine="0",model_name="stub-model"} 7.0\n'
    b"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    b"# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{engine="0",model_name="stub-model"} 0.05\n'
)


@dataclass
class StubEngine:
    # ok | error500 | hang_headers | hang_midstream | drop_midstream | until_disconnect
    # (after the first chunk, stream nothing until the sidecar closes the connection)
    mode: str = "ok"
    chunks: int = 3
    chunk_delay: float = 0.0
    head_delay: float = 0.0  # seconds before a stream's response head goes out
    model_id: str = "tiny"  # what /v1/models names (vLLM: the path, if no served name)
    # Set: every stream stops after its first chunk until the test sets the event (a
    # request that holds its slot for exactly as long as the test needs).
    hold: threading.Event | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    received_headers: list[dict[str, str]] = field(default_factory=list)
    scrape_headers: list[dict[str, str]] = field(default_factory=list)  # of GET /metrics
    active: int = 0  # generation requests currently being served
    disconnects: int = 0  # streams the sidecar closed in until_disconnect mode
    max_model_len: int = MAX_MODEL_LEN  # what /v1/models says
    tokenize_repeat: int = 1  # /tokenize answers each word's id this many times
    tokenize_gate: threading.Event | None = None  # set: /tokenize answers (None: at once)

    def release(self) -> None:
        """Let held streams go on (see `hold`)."""
        if self.hold is not None:
            self.hold.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = await read_body(receive)
        path = scope["path"]
        if path == "/health":
            await _json(send, 200, {})
        elif path == "/metrics":
            self.scrape_headers.append(
                {k.decode(): v.decode("latin-1") for k, v in scope["headers"]})
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                (b"content-length", str(len(VLLM_METRICS)).encode())]})
            await send({"type": "http.response.body", "body": VLLM_METRICS})
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [
                {"id": self.model_id, "root": self.model_id,
                 "max_model_len": self.max_model_len}]})
        elif path == "/tokenize":
            while self.tokenize_gate is not None and not self.tokenize_gate.is_set():
                await asyncio.sleep(0.005)
            payload = json.loads(body)
            text = payload.get("prompt") or json.dumps(payload.get("messages"))
            tokens = [16 + zlib.crc32(word.encode()) % 30_000 for word in text.split()
                      for _ in range(self.tokenize_repeat)]
            await _json(send, 200, {"count": len(tokens), "tokens": tokens,
                                    "max_model_len": MAX_MODEL_LEN})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self.active += 1
            try:
                await self._generate(scope, body, receive, send)
            finally:
                self.active -= 1
        else:
            await _json(send, 404, {"error": {"message": "not found"}})

    async def _generate(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        payload = json.loads(body)
        self.received.append(payload)
        self.received_headers.append(
            {k.decode(): v.decode("latin-1") for k, v in scope["headers"]})
        if self.mode == "error500":
            await _json(send, 500, {"error": {"message": "engine exploded", "code": 500}})
            return
        if self.mode == "hang_headers":
            await asyncio.sleep(3600)
        chat = scope["path"] == "/v1/chat/completions"
        max_tokens = payload.get("max_completion_tokens" if chat else "max_tokens") or 16
        usage = {"prompt_tokens": 1, "completion_tokens": max_tokens,
                 "total_tokens": 1 + max_tokens}
        if not payload.get("stream"):
            await _json(send, 200, {"object": "text_completion",
                                    "choices": [{"index": 0, "text": "ok"}], "usage": usage})
            return
        if self.head_delay:
            await asyncio.sleep(self.head_delay)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"x-upstream", b"stub"), (b"set-cookie", b"a=b")]})
        for i in range(self.chunks):
            if i and self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})
            if i == 0 and self.hold is not None:
                await asyncio.to_thread(self.hold.wait, 60)
            if i == 0 and self.mode == "hang_midstream":
                await asyncio.sleep(3600)
            if i == 0 and self.mode == "until_disconnect":
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnects += 1
                return
            if i == 0 and self.mode == "drop_midstream":
                raise RuntimeError("engine died mid-stream")
        await send({"type": "http.response.body", "more_body": False,
                    "body": b"data: " + json.dumps({"usage": usage}).encode()
                    + b"\n\ndata: [DONE]\n\n"})


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive) -> bytes:
    """The whole request body of an ASGI request."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body
