"""The streaming proxy to the engine: status and headers first, then chunks untouched.

Two clients, each for what it is good at: the data plane (generation requests) goes
through `UpstreamPool` (`upstream.lean_http`, C-parsed, one callback per chunk); control
calls (health probes, model card, /tokenize) go through one long-lived, cookieless
httpx client. Neither reads proxy settings from the environment.

An exchange runs as two tasks: the pump (open upstream, relay bytes) and a watcher for
the client's `http.disconnect`. Whichever ends first ends the other; the pump closes
the upstream response in its `finally` (aborting an unfinished one, so vLLM stops
generating) and reports the outcome exactly once, as soon as the engine is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx
from starlette.types import Receive, Send

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.auth.engine_key import EngineKey, KeyedPlane
from engine_sidecar.gateway.errors import ApiError, sse_error_event
from engine_sidecar.gateway.upstream import lean_http
from engine_sidecar.gateway.upstream.httpx_pool import HttpxPool
from engine_sidecar.gateway.upstream.lean_http import (
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)


HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# The only client headers the engine sees. vLLM acts on others: X-data-parallel-rank
# picks a rank, X-Vllm-Priority overrides the priority, X-Session-ID the session; the
# credentials are the sidecar's. W3C trace context passes (vLLM's tracing reads it), when
# well-formed. X-Request-Id is the one `request_id.RequestIds` chose (the client's when
# usable): vLLM names its request and response after it.
REQUEST_ALLOW = frozenset({b"content-type", b"accept", b"traceparent", b"tracestate",
                           b"x-request-id"})
TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
_TRACEPARENT = re.compile(rb"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}"
                          rb"-[0-9a-f]{2}")
MAX_TRACESTATE_BYTES = 512  # W3C: 32 list members; longer ones may be dropped
# Never forwarded, even if allowed: the client's credentials and our own inputs.
REQUEST_DROP = HOP_BY_HOP | {
    b"host", b"content-length", b"authorization", b"cookie", b"x-session-id", b"expect",
    b"accept-encoding",
}
RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date", b"set-cookie"}


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """Headers named in `Connection:` are hop-by-hop too (RFC 9110 7.6.1)."""
    names: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            names.update(t.strip().lower() for t in value.split(b","))
    return names


def filter_headers(
    headers: list[tuple[bytes, bytes]], drop: frozenset[bytes] | set[bytes]
) -> list[tuple[bytes, bytes]]:
    extra = _connection_tokens(headers)
    return [(k.lower(), v) for k, v in headers if k.lower() not in drop and k.lower() not in extra]


def request_headers(
    headers: list[tuple[bytes, bytes]], drop: frozenset[bytes] | set[bytes] = REQUEST_DROP
) -> list[tuple[bytes, bytes]]:
    """The client's headers that go to the engine: `REQUEST_ALLOW` minus `drop`, and trace
    context only when it is one well-formed `traceparent` (W3C Trace Context)."""
    kept = [(k, v) for k, v in filter_headers(headers, drop) if k in REQUEST_ALLOW]
    parents = [v for k, v in kept if k == b"traceparent"]
    states = [v for k, v in kept if k == b"tracestate"]
    if (len(parents) != 1 or not _TRACEPARENT.fullmatch(parents[0])
            or sum(len(v) for v in states) > MAX_TRACESTATE_BYTES):
        kept = [(k, v) for k, v in kept if k not in TRACE_CONTEXT]
    return kept


class UpstreamResponse(Protocol):
    """What both data planes return once status and headers are in."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes:
        """The body's next piece; b"" once it is all read."""
    async def aclose(self) -> None: ...


class DataPlane(Protocol):
    async def request(
        self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse: ...

    def close(self) -> None: ...


def upstream_error(exc: BaseException, timeout: float) -> tuple[ApiError, str]:
    """Transport failure -> (client error, metric kind); nothing internal leaks."""
    if isinstance(exc, UpstreamConnectError):
        return ApiError(503, errors.ENGINE_UNAVAILABLE,
                        "the inference engine is not accepting connections; retry later",
                        retry_after=1), "connect"
    if isinstance(exc, UpstreamTimeout | TimeoutError):
        return ApiError(504, errors.UPSTREAM_TIMEOUT,
                        f"the inference engine did not respond within {timeout:g}s"), "timeout"
    return ApiError(502, errors.UPSTREAM_ERROR,
                    "the inference engine closed the connection unexpectedly"), "protocol"


class Upstream:
    """The local engine: `pool` for the data plane, `client` for control calls. Both
    send `engine_key` (vLLM's --api-key, `auth.engine_key`) and never a client's
    credentials; an engine that answers 401 is explained (`engine_key.refused`)."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout: float,
        connect_timeout: float = 5.0,
        on_error: Callable[[str], None] | None = None,
        data_plane: str = "auto",
        engine_key: EngineKey | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--upstream must be an http:// URL of the local engine, "
                             f"got {base_url!r}")
        self.request_timeout = request_timeout
        self.base_url = base_url.rstrip("/")
        no_cookies = http.cookiejar.CookieJar(
            policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[])
        )
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            cookies=no_cookies,
            trust_env=False,  # never route engine traffic through an env proxy
            follow_redirects=False,
            headers=None if engine_key is None else {
                "authorization": engine_key.header.decode("latin-1")},
        )
        plane: DataPlane
        if data_plane == "httpx" or (data_plane == "auto" and not lean_http.AVAILABLE):
            if data_plane == "auto":
                logger.warning("httptools is not installed: streaming through httpx, which "
                               "costs several times more CPU per token chunk; install "
                               "uvicorn[standard]")
            plane = HttpxPool(self.client)
        else:
            plane = UpstreamPool(parts.hostname, parts.port or 80,
                                 connect_timeout=connect_timeout,
                                 read_timeout=request_timeout)
        self.pool: DataPlane = KeyedPlane(plane, engine_key)
        self._on_error = on_error

    async def aclose(self) -> None:
        self.pool.close()
        await self.client.aclose()

    async def open(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send, wait for status and headers; the body is left to stream."""
        try:
            return await self.pool.request(method, path, headers, body)
        except OSError as exc:
            raise self.failure(exc) from None

    def failure_status(self, status: int) -> ApiError:
        if self._on_error is not None:
            self._on_error(f"http_{status}")
        if status == 503:
            return ApiError(503, errors.ENGINE_UNAVAILABLE,
                            "the inference engine is unavailable (HTTP 503); retry later",
                            retry_after=1)
        if status == 504:
            return ApiError(504, errors.UPSTREAM_TIMEOUT,
                            "the inference engine timed out (HTTP 504)")
        return ApiError(502, errors.UPSTREAM_ERROR,
                        f"the inference engine failed to process the request (HTTP {status})")

    def failure(self, exc: BaseException) -> ApiError:
        error, kind = upstream_error(exc, self.request_timeout)
        if self._on_error is not None:
            self._on_error(kind)
        return error


async def read_capped(response: UpstreamResponse, limit: int, what: str) -> bytes:
    """A control call's whole answer, refused (502) past `limit` bytes: the engine's
    `what` must not make the sidecar buffer without bound."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise ApiError(502, errors.UPSTREAM_ERROR,
                           f"the inference engine's {what} answer is too large")
        chunks.append(chunk)
    return b"".join(chunks)


async def send_error(send: Send, error: ApiError) -> None:
    body = error.body()
    headers = [*error.raw_headers(), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


SERVER_TIMING = b"server-timing"


def server_timing(name: str, since: float) -> tuple[bytes, bytes]:
    """A W3C Server-Timing entry: `name` took from `since` (perf_counter) until now."""
    return SERVER_TIMING, f"{name};dur={(time.perf_counter() - since) * 1000:.2f}".encode()


@dataclass
class ExchangeResult:
    outcome: str = "cancelled"  # completed | upstream_error | timeout | cancelled | error
    status: int | None = None  # the engine's status, or the refusal's when it failed
    sent_status: int | None = None  # the status the client got (None: no answer)
    started: bool = False  # the response start went out
    ttft: float | None = None  # seconds from forwarding to the first body byte
    duration: float = 0.0


class _Pump:
    def __init__(
        self, send: Send, upstream: Upstream, result: ExchangeResult,
        on_done: Callable[[str], object],
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> None:
        self.send = send
        self.on_chunk = on_chunk
        self.upstream = upstream
        self.result = result
        self.on_done = on_done
        self.extra_headers = extra_headers or []
        self.finishing = False  # the last byte is being sent: a disconnect now is normal

    def _done(self, outcome: str) -> None:
        """The engine is finished with this request: settle before the client hears."""
        self.result.outcome = outcome
        self.on_done(outcome)

    async def run(self, opener: Callable[[], Awaitable[UpstreamResponse]], start: float) -> None:
        result = self.result
        send = self.send
        response: UpstreamResponse | None = None
        try:
            try:
                response = await opener()
            except ApiError as error:
                self._done("timeout" if error.status == 504 else "upstream_error")
                result.status = result.sent_status = error.status
                result.started = True
                await send_error(send, error)
                return
            result.status = response.status_code
            if response.status_code >= 500:
                # The engine's own 5xx bodies may carry internals: answer with ours.
                refusal = self.upstream.failure_status(response.status_code)
                await response.aclose()
                self._done("upstream_error")
                result.started = True
                result.sent_status = refusal.status
                await send_error(send, refusal)
                return
            result.sent_status = response.status_code
            await send({
                "type": "http.response.start", "status": response.status_code,
                "headers": [*filter_headers(response.raw_headers, RESPONSE_DROP),
                            *self.extra_headers, server_timing("upstream", start)],
            })
            result.started = True
            on_chunk = self.on_chunk
            read = response.read  # a coroutine per chunk, no async generator
            try:
                while chunk := await read():
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - start
                    if on_chunk is not None:
                        on_chunk(chunk)
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            except OSError as exc:
                failure = self.upstream.failure(exc)
                await response.aclose()
                self._done("timeout" if failure.status == 504 else "upstream_error")
                content_type = response.header(b"content-type") or b""
                if content_type.startswith(b"text/event-stream"):
                    self.finishing = True
                    await send({"type": "http.response.body",
                                "body": sse_error_event(failure), "more_body": False})
                # Otherwise leave the response incomplete: the server drops the connection,
                # which is how a client learns that a plain body was cut short.
                return
            self.finishing = True
            await response.aclose()
            self._done("completed" if response.status_code < 400 else "upstream_error")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if response is not None:
                await response.aclose()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def exchange(
    receive: Receive,
    send: Send,
    upstream: Upstream,
    opener: Callable[[], Awaitable[UpstreamResponse]],
    on_done: Callable[[str], object] = lambda _outcome: None,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    on_chunk: Callable[[bytes], None] | None = None,
) -> ExchangeResult:
    """Run one proxied exchange to its end; never raises for client or engine failures.

    `receive` must have delivered the whole request body already. `on_done(outcome)`
    runs as soon as the engine is finished with the request (before the client sees the
    last byte); on a client disconnect the caller settles after this returns.
    `extra_headers` go out with the engine's response headers; `on_chunk` sees every
    body chunk of a response the engine accepted, before the client does.
    """
    result = ExchangeResult()
    pump = _Pump(send, upstream, result, on_done, extra_headers, on_chunk)
    start = time.perf_counter()
    pump_task = asyncio.ensure_future(pump.run(opener, start))
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((pump_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # The client left (or we are being cancelled): stop the pump unless it is only
        # sending the last byte. Its `finally` closes the upstream response.
        watcher.cancel()
        if not pump_task.done() and not pump.finishing:
            pump_task.cancel()
        try:
            await pump_task
        except asyncio.CancelledError:
            result.outcome = "cancelled"
        except Exception as exc:
            result.outcome = "error"
            logger.error("proxy failure (%s)", type(exc).__name__, exc_info=exc)
        result.duration = time.perf_counter() - start
    if result.outcome == "error" and not result.started:
        result.sent_status = 500
        with contextlib.suppress(Exception):
            await send_error(send, ApiError(500, errors.INTERNAL_ERROR,
                                            "the sidecar failed to proxy this request"))
    return result
