"""Reading a request body: only after the caller is known, bounded in size and time.

A body is read after authentication, so a client without credentials never makes the
sidecar buffer one. Its cap comes from what the tenant may be admitted (every prompt of
an admissible request fits in the tenant's block ceiling, and a chat prompt in its
`maxPromptTokens`), at a generous bytes-per-token bound, under the global cap. The
deadline covers the whole body: a client that trickles it holds a connection for at
most that long.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from engine_sidecar.contract.policy import TenantPolicy

# JSON-escaped text (`\uXXXX` per character, surrogate pairs for emoji), long tokens
# (runs of spaces) and token-id lists all stay well under this per prompt token.
BODY_BYTES_PER_TOKEN = 64
BODY_OVERHEAD_BYTES = 64 * 1024  # sampling parameters, tools, response_format, ...
CLOSE = {"connection": "close"}


def body_limit(
    tenant: TenantPolicy, *, block_size: int, chat: bool, cap: int,
    bytes_per_token: int = BODY_BYTES_PER_TOKEN,
) -> int:
    """The largest body an admissible request of `tenant` can need, at most `cap`."""
    tokens = tenant.max_blocks_per_engine * block_size  # larger prompts are refused (400) anyway
    if chat and tenant.max_prompt_tokens is not None:  # one prompt per chat request
        tokens = min(tokens, tenant.max_prompt_tokens)
    return min(cap, BODY_OVERHEAD_BYTES + bytes_per_token * tokens)


def declared_length(scope: Scope) -> int | None:
    """Content-Length, if the client sent one (uvicorn refuses a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


def declares_body(scope: Scope) -> bool:
    length = declared_length(scope)
    if length is not None:
        return length > 0
    return any(name == b"transfer-encoding" for name, _ in scope["headers"])


def too_large(limit: int) -> ApiError:
    shown = f"{limit // (1024 * 1024)} MiB" if limit >= 1024 * 1024 else f"{limit} bytes"
    return ApiError(413, errors.REQUEST_TOO_LARGE,
                    f"the request body exceeds {shown}, the largest this caller may send",
                    headers=dict(CLOSE))


async def read_body(
    receive: Receive, limit: int, timeout: float, declared: int | None = None
) -> bytes | None:
    """The whole request body; None if the client went away first. 413 past `limit`
    bytes (at once if the declared length says so), 408 if it is not all in within
    `timeout` seconds; both close the connection."""
    if declared is not None and declared > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise ApiError(408, errors.REQUEST_TIMEOUT,
                       f"the request body did not arrive within {timeout:g}s",
                       headers=dict(CLOSE)) from None


def unread(scope: Scope, error: ApiError) -> ApiError:
    """`error` as the answer to a request whose body was not read: the connection
    closes, so the client cannot keep it open by sending the rest slowly."""
    if not declares_body(scope) or error.headers.get("connection") == "close":
        return error
    return dataclasses.replace(error, headers={**error.headers, **CLOSE})


def closing(scope: Scope, send: Send) -> Send:
    """`send` for routes that never read a body: one the client declared closes the
    connection after the response."""
    if scope["type"] != "http" or not declares_body(scope):
        return send

    async def send_closing(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"connection", b"close")]}
        await send(message)

    return send_closing
