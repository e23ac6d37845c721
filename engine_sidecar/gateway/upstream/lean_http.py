"""A lean HTTP/1.1 client for the data plane: asyncio Protocol + httptools (llhttp).

Relaying an SSE stream costs one parse and one hand-off per token chunk; through httpx
that is an order of magnitude more Python per chunk than one C-level parse and one
callback here. httpx stays the client for control calls, where per-call cost does not
matter. Scope is narrow: one origin, HTTP/1.1, a LIFO keep-alive pool (idle connections
expire 4 s after their last response, below uvicorn's 5 s), bodies in one write,
Content-Length or chunked responses, read back-pressure, an inactivity timeout.

A reused connection the engine closed before answering is retried once on a fresh one,
as Go's net/http does; a fresh connection, or one that got any byte, is never resent.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import AsyncIterator
from typing import cast

try:
    import httptools
except ImportError:  # uvicorn without [standard]: relay.exchange falls back to httpx
    httptools = None  # type: ignore[assignment]

AVAILABLE = httptools is not None

KEEPALIVE_EXPIRY = 4.0  # seconds; below uvicorn's default timeout_keep_alive of 5
HIGH_WATER = 256 * 1024  # pause reading the engine when this much is queued


class UpstreamConnectError(ConnectionError):
    """Could not connect to the engine."""


class UpstreamTimeout(TimeoutError):
    """The engine did not answer (headers or next chunk) in time."""


class UpstreamProtocolError(ConnectionError):
    """The engine closed the connection mid-response or sent invalid HTTP."""


def _expire(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout(f"no data from the engine for {timeout:g}s"))


class _Connection(asyncio.Protocol):
    """One upstream connection; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # its own: looked up once
        self.closed = False
        self.idle_since = 0.0
        self.deadline = 0.0  # loop time: the current wait's silence ends there
        self.timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.received = False  # any byte of this exchange's response
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.delimited = False  # Content-Length or chunked (else: ends at EOF)
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(UpstreamProtocolError("invalid HTTP from the engine"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_watch()
        if self.headers_done and not self.delimited and not self.complete:
            self.complete = True  # body delimited by EOF
        if not self.complete:
            self._fail(UpstreamProtocolError("the engine closed the connection"))
        self._wake()

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:  # the response's first byte, once per exchange
        self.received = True

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered in (b"content-length", b"transfer-encoding"):
            self.delimited = True
        self.raw_headers.append((lowered, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.queued += len(body)
        if self.queued > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.idle_since = time.monotonic()  # the engine's idle timer starts about now
        self._wake()

    # -- plumbing ------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def news(self, timeout: float) -> asyncio.Future[None]:
        """Done when the parser has news; failed (UpstreamTimeout) after `timeout` seconds
        of silence.

        This runs once per token chunk, so it is a plain future on the connection's
        loop (no coroutine, no loop lookup) and arms no timer of its own (a timer handle
        made and cancelled per chunk cost more than the rest of the wait): it moves the
        connection's deadline, and one timer per connection (`_watch`) fires at the
        earliest deadline and moves itself on to the current one."""
        loop = self.loop
        assert loop is not None
        waiter = self.waiter = loop.create_future()
        deadline = self.deadline = loop.time() + timeout
        self.timeout = timeout
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._watch)
        return waiter

    def _watch(self) -> None:
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms the timer again
        loop = self.loop
        assert loop is not None
        if loop.time() >= self.deadline:
            self.waiter = None
            _expire(waiter, self.timeout)
        else:
            self._timer = loop.call_at(self.deadline, self._watch)

    def _stop_watch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> bytes:
        """Everything queued, as one piece: when the consumer lags behind the engine,
        chunks already here go out in one write instead of one write each."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.queued = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return (not self.closed and self.complete and self.keep_alive and self.error is None
                and not self.chunks)

    def abort(self) -> None:
        self.closed = True
        self._stop_watch()
        if self.transport is not None:
            self.transport.abort()


def find_header(raw_headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """First value of a lower-case header name in raw (lower-cased) headers."""
    for key, value in raw_headers:
        if key == name:
            return value
    return None


class UpstreamResponse:
    """Status and headers are in; the body streams through `aiter_raw()`."""

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status_code = conn.status
        self.raw_headers = conn.raw_headers

    def header(self, name: bytes) -> bytes | None:
        return find_header(self.raw_headers, name)

    async def read(self) -> bytes:
        """The body's next piece (all that is queued, as one); b"" once it is all read."""
        conn = self._conn
        if conn is None:
            return b""
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.news(self._pool.read_timeout)
        return conn.take()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.news(self._pool.read_timeout)

    async def aclose(self) -> None:
        """Return a finished connection to the pool; abort an unfinished one (so the
        engine sees the client leave and stops generating)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            self._pool.release(conn)
        else:
            conn.abort()


class UpstreamPool:
    def __init__(
        self, host: str, port: int, *, connect_timeout: float, read_timeout: float,
        max_idle: int = 256,
    ) -> None:
        if not AVAILABLE:
            raise RuntimeError("the fast data plane needs httptools (uvicorn[standard])")
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._host_header = f"{host}:{port}".encode()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError:
            raise UpstreamConnectError("connect timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"connect failed ({type(exc).__name__})") from None
        return conn

    def _checkout(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            # Closed by the engine, or bytes arrived while idle (not HTTP we can trust).
            healthy = not conn.closed and conn.error is None and not conn.headers_done
            if healthy and now - conn.idle_since < KEEPALIVE_EXPIRY:
                return conn
            conn.abort()
        return None

    def release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            conn.abort()
            return
        conn._reset()
        self._idle.append(conn)

    async def request(
        self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        head = [f"{method} {target} HTTP/1.1\r\n".encode(), b"host: ", self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for key, value in headers:
            head += [key, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        message = b"".join(head) + body
        conn = self._checkout()
        if conn is not None:
            try:
                return await self._exchange(conn, message)
            except UpstreamProtocolError:
                if conn.received:
                    raise
        return await self._exchange(await self._connect(), message)

    async def _exchange(self, conn: _Connection, message: bytes) -> UpstreamResponse:
        """Send `message`, wait for status and headers."""
        assert conn.transport is not None
        try:
            conn.transport.write(message)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.news(self.read_timeout)
        except BaseException:
            conn.abort()
            raise
        return UpstreamResponse(self, conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.abort()
        self._idle.clear()
