"""The sidecar's two HTTP servers, and what one connection may hold on either.

The client port serves /v1/* and health; the admin port serves status, metrics and
health to the operator, Prometheus and the kubelet. Each is its own uvicorn server in
one event loop, so a flood on the client port never starves the operator's status poll
or the kubelet's probes.

uvicorn has no deadline for a request head on httptools, and httptools buffers a header
of any length, so `GuardedHttpToolsProtocol` bounds the head in time and size (408 /
431, then closed), answers a request it cannot parse (400 INVALID_REQUEST, closed)
and keeps the connection limit (503 TOO_MANY_CONNECTIONS), in
place of uvicorn's `limit_concurrency`, so that refusal, like the 408 and 431, is the
sidecar's JSON error with `x-request-id`. The keep-alive timeout and the event loop
(uvloop where installed: it costs less per chunk) are uvicorn's; docs/gateway.md lists
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import resource
import socket
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine_sidecar.gateway import errors, request_id
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.telemetry.pause_probe import probe_from_env

logger = logging.getLogger(__name__)

FD_RESERVE = 64  # listeners, the policy watch, httpx, tokenizer files, logs
ADMIN_MAX_CONNECTIONS = 32  # the operator, Prometheus and the kubelet


def default_max_connections() -> int:
    """Client connections that fit the process's file-descriptor limit: each may hold a
    second descriptor towards the engine while its request streams."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(8, min(4096, (soft - FD_RESERVE) // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout: float = 10.0  # seconds for a request's line and headers
    max_head_bytes: int = 64 * 1024
    keep_alive_timeout: int = 5  # seconds an idle kept-alive connection stays open
    max_connections: int | None = None  # None: default_max_connections()

    def connections(self) -> int:
        return self.max_connections or default_max_connections()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size bound on each request
    head, and the connection limit. Subclassed per server by `guarded_protocol`
    (uvicorn builds protocols from the class alone)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._served = self.app
        self.app = self._within_limit  # what each request's ASGI task runs
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_begun = False  # a byte of the awaited head arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is None or self.transport.is_closing():
            return
        # The head is still incomplete: this chunk was all head (pipelined requests
        # aside, where it may also end the previous body; the bound stays a bound).
        self._head_bytes += len(data)
        if self._head_bytes > self.limits.max_head_bytes:
            self._refuse(ApiError(
                431, errors.REQUEST_HEADERS_TOO_LARGE,
                f"the request line and headers exceed {self.limits.max_head_bytes} bytes"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a kept-alive connection's next request
            self._await_head()
        self._head_begun = True

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()

    def _await_head(self) -> None:
        self._head_bytes = 0
        self._head_begun = False
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_expired)

    def _head_done(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._head_begun:  # opened and never used: nothing to answer
            self.transport.close()
            return
        self._refuse(ApiError(
            408, errors.REQUEST_TIMEOUT,
            f"the request line and headers did not arrive within "
            f"{self.limits.head_timeout:g}s"))

    def send_400_response(self, msg: str) -> None:
        """A request that is not valid HTTP (httptools could not parse it): the
        sidecar's JSON 400, with `x-request-id`, in place of uvicorn's plain text."""
        self._refuse(ApiError(400, errors.INVALID_REQUEST,
                              "the request is not valid HTTP/1.1; nothing was read"))

    async def _within_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The server's app, or 503 TOO_MANY_CONNECTIONS beyond the limit: more than
        `limits.connections()` connections open (this one included), or as many
        requests running besides this one (what uvicorn's `limit_concurrency` of one
        more refused). Then the connection closes (a descriptor back); the body is left
        to uvicorn."""
        limit = self.limits.connections()
        if scope["type"] != "http" or (len(self.connections) <= limit
                                       and len(self.tasks) <= limit + 1):
            await self._served(scope, receive, send)
            return
        logger.warning("refused a request: %d connections open, %d requests running "
                       "(limit %d)", len(self.connections), len(self.tasks) - 1, limit)
        error = ApiError(503, errors.TOO_MANY_CONNECTIONS,
                         f"the sidecar has more than its {limit} connections open; retry "
                         "shortly", retry_after=1)
        body = error.body()
        raw_id = request_id.chosen(scope["headers"]).encode("ascii")
        await send({"type": "http.response.start", "status": error.status, "headers": [
            *error.raw_headers(), (request_id.HEADER, raw_id), (b"connection", b"close"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _refuse(self, error: ApiError) -> None:
        """Answer and close, unless a response is going out on this connection (a
        pipelined request's head): then only close. The answer's `x-request-id` is the
        client's when it came with the headers read so far, else a new one."""
        self._head_done()
        if self.cycle is None or self.cycle.response_complete:
            body = error.body()
            phrase = http.HTTPStatus(error.status).phrase.encode()
            raw_id = request_id.chosen(self.headers or []).encode("ascii")
            head = [b"HTTP/1.1 %d %s\r\n" % (error.status, phrase)]
            head += [name + b": " + value + b"\r\n" for name, value in
                     [*error.raw_headers(), (request_id.HEADER, raw_id)]]
            head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def server_config(
    app: Any, limits: ConnectionLimits, *, lifespan: str, log_level: str = "info",
    access_log: bool = False, timeout_graceful_shutdown: int | None = 30,
) -> uvicorn.Config:
    """The uvicorn settings both ports run with (the tests use this too)."""
    return uvicorn.Config(
        app, http=guarded_protocol(limits), ws="none", lifespan=lifespan,  # type: ignore[arg-type]
        interface="asgi3", log_level=log_level, access_log=access_log, server_header=False,
        proxy_headers=False,  # client addresses are not used; skip the middleware
        timeout_keep_alive=limits.keep_alive_timeout,
        limit_concurrency=None,  # the guarded protocol keeps the limit (its own 503)
        timeout_graceful_shutdown=timeout_graceful_shutdown,
    )


def listen(host: str, port: int, flag: str) -> socket.socket:
    """Bind before serving, so a taken port is one clear error, not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"{flag} {host}:{port}: cannot listen ({exc.strerror})") from None
    return sock


class AdminServer(uvicorn.Server):
    """The admin port's server: it stops when the client server has stopped, and leaves
    the signals to it (the kubelet's probes keep answering while requests drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def run(main: Coroutine[Any, Any, None], loop: str = "auto") -> None:
    """Run `main` to its end in a new event loop: uvloop's (`auto`: when installed), or
    asyncio's."""
    if loop not in EVENT_LOOPS:
        raise ValueError(f"event loop {loop!r}: use one of {', '.join(EVENT_LOOPS)}")
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise SystemExit("--event-loop uvloop: uvloop is not installed (install "
                                 "uvicorn[standard])") from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


async def serve(
    client: uvicorn.Server, client_sock: socket.socket,
    admin: AdminServer, admin_sock: socket.socket,
) -> None:
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]), name="admin-server")
    probe = probe_from_env()  # the perf harness's loop-lag and GC probe; off by default
    probe_task = asyncio.create_task(probe.run(), name="pause-probe") if probe else None
    try:
        await client.serve(sockets=[client_sock])
    finally:
        admin.should_exit = True
        await admin_task
        if probe_task is not None:
            probe_task.cancel()
