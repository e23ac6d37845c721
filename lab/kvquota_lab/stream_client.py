"""The lab's one streamed-completion client: token ids in, token ids out.

Every load the lab sends to vLLM's OpenAI server or to the sidecar (the demo's load
generator, the engine bench, calibration) goes through `stream_completion`: one
`POST /v1/completions` with `stream` and `return_token_ids`, read as server-sent
events. It records, by an injectable clock, when the request went out, when the
response head came, when the first and the last token came (a choice carrying token
ids or text: a byte-level token can decode to no text on its own) and when the stream
ended; the generated ids; the usage (prompt and cached tokens, with
`--enable-prompt-tokens-details`); the sidecar's queue header; and for a refusal its
error code and Retry-After. A transport error is an answer too: status 0, the
exception's name as its code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

QUEUE_HEADER = "x-kvquota-queue-ms"  # admitted after waiting this long in the sidecar's queue


def no_headers(_tenant: str) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Target:
    """Where to send requests and how a tenant authenticates there (picklable when
    `headers` is: a client process of its own may get it)."""

    url: str
    model: str
    headers: Callable[[str], dict[str, str]] = no_headers

    def request_headers(self, tenant: str, session: str | None = None) -> dict[str, str]:
        """The tenant's headers, with `X-Session-Id` when there is a session."""
        headers = dict(self.headers(tenant))
        if session:
            headers["X-Session-Id"] = session
        return headers


def completion_body(model: str, prompt: list[int], max_tokens: int | None) -> dict[str, Any]:
    """A greedy streamed completion of token ids that reports its usage and returns
    the generated ids (`max_tokens` None: not sent, the server's default applies)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


@dataclass
class Streamed:
    """One answer. Times are the clock's readings; None where it did not happen."""

    status: int  # 0: no HTTP answer (transport error or timeout, see `code`)
    sent: float
    head: float | None = None  # the response head arrived
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None  # the body was read to its end (or the error came)
    token_ids: list[int] = field(default_factory=list)
    code: str | None = None  # a refusal's error code, or the transport error's name
    retry_after: float | None = None
    queue_ms: float | None = None  # the sidecar's x-kvquota-queue-ms, when it sends one
    server_timing: list[str] = field(default_factory=list)  # Server-Timing header values
    prompt_tokens: int | None = None  # None: no usage reported
    cached_tokens: int | None = None  # None: no prompt_tokens_details reported


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _error_code(raw: bytes) -> str | None:
    try:
        code = json.loads(raw)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return str(code) if code else None


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any],
    headers: dict[str, str] | None = None, *, clock: Callable[[], float] = time.perf_counter,
    on_answer: Callable[[], None] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> Streamed:
    """POST `body` to `url`/v1/completions and read the stream. `on_answer` runs when
    the response's status arrives, `on_first_token` with the first token."""
    sent = clock()
    reply = Streamed(200, sent)
    usage: dict[str, Any] = {}
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as resp:
            reply.head = clock()
            if on_answer:
                on_answer()
            if resp.status_code != 200:
                reply.code = _error_code(await resp.aread())
                reply.status, reply.finish = resp.status_code, clock()
                reply.retry_after = _seconds(resp.headers.get("retry-after"))
                return reply
            reply.queue_ms = _seconds(resp.headers.get(QUEUE_HEADER))
            reply.server_timing = resp.headers.get_list("server-timing")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids or choice.get("text"):
                        reply.last_token = clock()
                        if reply.first_token is None:
                            reply.first_token = reply.last_token
                            if on_first_token:
                                on_first_token()
                        reply.token_ids.extend(ids)
    except httpx.HTTPError as exc:
        return Streamed(0, sent, finish=clock(), code=type(exc).__name__)
    reply.finish = clock()
    prompt_tokens = usage.get("prompt_tokens")
    reply.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details:
        reply.cached_tokens = int(details.get("cached_tokens") or 0)
    return reply
