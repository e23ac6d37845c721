"""CPU the sidecar's relay spends per streamed request: `python -m kvquota_lab.perf.sidecar
relay`.

One process, one core, no load generator: an in-process upstream streams SSE chunks of
vLLM's size as fast as the loop runs them, and each request is read once straight from
it (a bare protocol) and once through the sidecar's relay (`relay.exchange` over the
lean data plane, with the output meter every admitted request runs). The difference in
process CPU is the relay's, per request and per chunk. Run on one quiet core it moves
by a few percent between runs of the same code, where the latency bench's CPU per
request moves by ten: it is the instrument for changes to the per-chunk path.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

EVENT = (b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"stub",'
         b'"choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null}]}\n\n')
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
END = b"data: [DONE]\n\n"


def _framed(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


class _Upstream(asyncio.Protocol):
    """Answers each request with `chunks` chunked SSE events, one loop turn apart."""

    chunks = 32

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.pending = b""
        self.streams: set[asyncio.Task[None]] = set()

    def data_received(self, data: bytes) -> None:
        self.pending += data
        head, sep, rest = self.pending.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if len(rest) >= length:
            self.pending = rest[length:]
            task = asyncio.ensure_future(self._stream())
            self.streams.add(task)
            task.add_done_callback(self.streams.discard)

    async def _stream(self) -> None:
        self.transport.write(HEAD)
        event = _framed(EVENT)
        for _ in range(self.chunks):
            await asyncio.sleep(0)
            self.transport.write(event)
        self.transport.write(_framed(END) + b"0\r\n\r\n")


class _Reader(asyncio.Protocol):
    """The direct path: reads one response to its chunked end, nothing else."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tail = b""

    def data_received(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-5:]
        if self.tail == b"0\r\n\r\n" and not self.done.done():
            self.done.set_result(None)


async def _cpu_per_call(call: Callable[[], Awaitable[None]], requests: int, rounds: int
                        ) -> float:
    """Least process CPU seconds per call over `rounds` rounds of `requests` calls, 16 at
    a time (streams interleave on the loop as they do in the sidecar)."""
    for _ in range(16):
        await call()
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(requests // 16):
            await asyncio.gather(*(call() for _ in range(16)))
        best = min(best, (time.process_time() - started) / (requests // 16 * 16))
    return best


async def measure(chunks: int, requests: int, rounds: int) -> dict[str, float]:
    """CPU us per request read directly and through the relay, and the relay's share."""
    from engine_sidecar.gateway.relay.exchange import Upstream, exchange
    from engine_sidecar.gateway.relay.output_meter import OutputMeter

    loop = asyncio.get_running_loop()
    _Upstream.chunks = chunks
    server = await loop.create_server(_Upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    body = b'{"model":"stub","prompt":"x","max_tokens":32,"stream":true}'
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: "
               b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    idle: list[tuple[Any, _Reader]] = []

    async def direct() -> None:
        transport, reader = idle.pop() if idle else await loop.create_connection(
            _Reader, "127.0.0.1", port)
        transport.write(request)
        await reader.done
        reader.done, reader.tail = loop.create_future(), b""
        idle.append((transport, reader))

    upstream = Upstream(f"http://127.0.0.1:{port}", request_timeout=30.0)
    headers = [(b"content-type", b"application/json")]

    relayed_bytes = 0

    async def send(message: MutableMapping[str, Any]) -> None:
        """The client side of ASGI: uvicorn's cost is not the relay's."""
        nonlocal relayed_bytes
        relayed_bytes += len(message.get("body", b""))

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def relayed() -> None:
        meter = OutputMeter("completion")
        await exchange(receive, send, upstream,
                       lambda: upstream.open("POST", "/v1/completions", headers, body),
                       on_chunk=meter.feed)

    try:
        direct_s = await _cpu_per_call(direct, requests, rounds)
        relayed_s = await _cpu_per_call(relayed, requests, rounds)
        calls = 16 + rounds * (requests // 16 * 16)
        body_bytes = chunks * len(EVENT) + len(END)
        if relayed_bytes != calls * body_bytes:  # else it measured failed exchanges
            raise RuntimeError(f"the relay delivered {relayed_bytes} bytes, not "
                               f"{calls} x {body_bytes}")
    finally:
        await upstream.aclose()
        for transport, _ in idle:
            transport.close()
        server.close()
    relay_us = (relayed_s - direct_s) * 1e6
    return {"direct_us": direct_s * 1e6, "relayed_us": relayed_s * 1e6,
            "relay_us": relay_us, "relay_us_per_chunk": relay_us / (chunks + 1)}


def run(args: argparse.Namespace) -> int:
    coroutine = measure(args.chunks, args.requests, args.rounds)
    try:
        import uvloop
    except ImportError:  # the sidecar's own fallback
        loop_name, result = "asyncio", asyncio.run(coroutine)
    else:
        loop_name, result = "uvloop", uvloop.run(coroutine)
    print(f"{args.chunks} chunks per request, best of {args.rounds} rounds of "
          f"{args.requests} requests ({loop_name}):")
    print(f"  read directly      {result['direct_us']:8.1f} us CPU per request")
    print(f"  through the relay  {result['relayed_us']:8.1f} us CPU per request")
    print(f"  the relay's part   {result['relay_us']:8.1f} us per request, "
          f"{result['relay_us_per_chunk']:.2f} us per chunk")
    return 0


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("relay", help="CPU of the relay per streamed request, in "
                                          "one process (pin it: taskset -c N)",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    parser.set_defaults(func=run)
