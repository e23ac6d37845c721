"""The data-plane HTTP client: keep-alive reuse, engines that close, bad HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from engine_sidecar.gateway.upstream.lean_http import (
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return await reader.readexactly(length)


async def _body(pool: UpstreamPool) -> bytes:
    response = await pool.request("POST", "/v1/completions", [], b"{}")
    try:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


async def test_keeps_connections_alive_and_survives_engines_closing_them() -> None:
    accepted = 0

    async def one_response_per_connection(reader: asyncio.StreamReader,
                                          writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # closes without announcing it, as an idle timeout does

    server, port = await _serve(one_response_per_connection)
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=2, read_timeout=2)
    async with server:
        assert await _body(pool) == b"ok"
        await asyncio.sleep(0.05)
        assert await _body(pool) == b"ok"  # the closed idle connection was not reused
    assert accepted == 2
    pool.close()


async def test_reuses_a_kept_alive_connection_for_chunked_streams() -> None:
    accepted = 0

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            await writer.drain()

    server, port = await _serve(chunked)
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=2, read_timeout=2)
    async with server:
        assert [await _body(pool) for _ in range(3)] == [b"hello world"] * 3
        pool.close()
    assert accepted == 1


async def test_failures_are_typed() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        await writer.drain()
        writer.close()

    for handler, error in ((garbage, UpstreamProtocolError), (silent, UpstreamTimeout),
                           (cut, UpstreamProtocolError)):
        server, port = await _serve(handler)
        pool = UpstreamPool("127.0.0.1", port, connect_timeout=2, read_timeout=0.2)
        async with server:
            with pytest.raises(error):
                await _body(pool)
            server.close()
        pool.close()

    server, port = await _serve(silent)
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamConnectError):
        await _body(UpstreamPool("127.0.0.1", port, connect_timeout=1, read_timeout=1))


async def _idle_close_on_second_request(reply: bytes) -> tuple[list[int], list[int]]:
    """The first connection answers once, then meets the next request as an engine whose
    keep-alive timer fired does: `reply` (nothing, or part of a response), then close.
    Later connections answer every request. Two requests go out; returns the requests
    each connection got, and each request's body length (-1: UpstreamProtocolError)."""
    requests: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(requests)
        requests.append(0)
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            requests[index] += 1
            if index == 0 and requests[index] == 2:
                writer.write(reply)
                await writer.drain()
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    server, port = await _serve(handler)
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=2, read_timeout=2)
    outcomes: list[int] = []
    async with server:
        for _ in range(2):
            try:
                outcomes.append(len(await _body(pool)))
            except UpstreamProtocolError:
                outcomes.append(-1)
        pool.close()
    return requests, outcomes


async def test_a_kept_alive_connection_closed_as_the_request_crosses_it_is_retried_once() -> None:
    # Nothing came back: the engine closed the idle connection, so it goes again, once.
    requests, outcomes = await _idle_close_on_second_request(b"")
    assert outcomes == [2, 2]
    assert requests == [2, 1]  # two connections; the second got the retried request

    # Part of a response came back: the engine had the request, so it is not sent twice.
    requests, outcomes = await _idle_close_on_second_request(b"HTTP/1.1 200 OK\r\n")
    assert outcomes == [2, -1]
    assert requests == [2]  # one connection
