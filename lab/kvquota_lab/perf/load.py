"""The perf harnesses' load generator: closed-loop streams of raw HTTP/1.1 requests.

It speaks HTTP over asyncio streams itself, so its own overhead stays out of the
numbers it takes (`Sample`: time to first byte and total, per request).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Sample:
    ttft: float
    total: float
    status: int = 200  # any other: a refusal (e.g. 503 TOKENIZER_BUSY), kept out of the times


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed before the status line")
    status = int(status_line.split()[1])
    headers: dict[bytes, bytes] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            return status, headers
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip()


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes],
                     start: float) -> float:
    """Consume the body; return the time its first byte arrived."""
    first: float | None = None
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            await reader.readexactly(size + 2)
            first = first or time.perf_counter()
    else:
        length = int(headers.get(b"content-length", b"0"))
        if length:
            await reader.readexactly(length)
            first = time.perf_counter()
    return (first or time.perf_counter()) - start


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, path: str, body: bytes, headers: dict[str, str]) -> Sample:
        """One request; once more on a new connection if the server had just closed the
        kept-alive one (its keep-alive timeout racing this request)."""
        reused = self.writer is not None
        try:
            return await self._request(path, body, headers)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
            self.close()
            self.reader = self.writer = None
            return await self._request(path, body, headers)

    async def _request(self, path: str, body: bytes, headers: dict[str, str]) -> Sample:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.reader is not None
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        start = time.perf_counter()
        self.writer.write("\r\n".join(head).encode() + body)
        status, response_headers = await _read_headers(self.reader)
        ttft = await _read_body(self.reader, response_headers, start)
        total = time.perf_counter() - start
        return Sample(ttft, total, status)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict[str, str]


UNIQUE = b"#REQ#"  # in a body: replaced by a number of its own in every request
# One sequence for the whole process: no number repeats across rows (concurrency levels,
# warm-ups), so the sidecar's token cache never serves a body it saw in an earlier row.
_NUMBERS = itertools.count()


async def run_load(targets: list[Target], body: bytes, concurrency: int, requests: int,
                   think_ms: float = 0.0, path: str = "/v1/completions"
                   ) -> list[list[Sample]]:
    """`concurrency` closed-loop streams sending `requests` requests per target.

    Each stream alternates between the targets request by request (one keep-alive
    connection to each), so direct and proxied requests see the same engine state at
    the same moment: a paired design that cancels drift and the engine's own regime
    changes. Each stream pauses a random [0, think_ms] before a request (not measured)
    so streams do not run in lockstep."""
    samples: list[list[Sample]] = [[] for _ in targets]
    remaining = requests * len(targets)
    unique = UNIQUE in body
    rng = random.Random(concurrency)

    async def worker(offset: int) -> None:
        nonlocal remaining
        connections = []
        for target in targets:
            parts = urlsplit(target.url)
            connections.append(Connection(parts.hostname or "127.0.0.1", parts.port or 80))
        turn = offset
        try:
            while remaining > 0:
                remaining -= 1
                index = turn % len(targets)
                turn += 1
                # Numbered before the pause: `remaining` moves while this stream sleeps.
                payload = body.replace(UNIQUE, str(next(_NUMBERS)).encode()) if unique else body
                if think_ms:
                    await asyncio.sleep(rng.uniform(0, think_ms) / 1000)
                samples[index].append(await connections[index].request(
                    path, payload, targets[index].headers))
        finally:
            for connection in connections:
                connection.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples
