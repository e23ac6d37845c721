"""The latency bench sends every request with a prompt of its own: a body
seen twice would be counted from the sidecar's token cache, and the bench would report
less CPU per request than unique traffic costs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvquota_lab.perf.load import UNIQUE, Target, run_load
from kvquota_lab.perf.relay import measure as measure_relay
from kvquota_lab.perf.sidecar import Row, main


async def _recording_server(bodies: list[bytes]) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                bodies.append(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_no_body_repeats_across_streams_pauses_and_runs() -> None:
    async def scenario() -> list[bytes]:
        bodies: list[bytes] = []
        server, url = await _recording_server(bodies)
        async with server:
            targets = [Target(url, {}), Target(url, {})]
            template = b'{"prompt": "request ' + UNIQUE + b'"}'
            for concurrency in (8, 32):  # two rows against the same sidecar
                await run_load(targets, template, concurrency, 40, think_ms=5.0)
        return bodies

    bodies = asyncio.run(scenario())
    assert len(bodies) == 2 * 40 * 2
    assert len(set(bodies)) == len(bodies)


def test_a_refused_request_is_counted_not_timed_and_the_run_goes_on() -> None:
    """At 256 streams a sidecar past its limits answers 503 TOKENIZER_BUSY: the row
    reports how many, and the times are those of the answered requests."""

    async def scenario() -> list[list[Any]]:
        answered = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal answered
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    await reader.readexactly(length)
                    answered += 1
                    status = b"503 Service Unavailable" if answered % 2 else b"200 OK"
                    writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            return await run_load([Target(url, {}), Target(url, {})], b"{}", 1, 10)

    direct, proxied = asyncio.run(scenario())
    row = Row(1, direct, proxied)
    assert len(direct) + len(proxied) == 20
    assert row.refused("direct") + row.refused("sidecar") == 10
    stats = row.stats()
    assert stats["direct_refused"] + stats["sidecar_refused"] == 10
    assert stats["sidecar_ttft_p50"] > 0


def test_a_chat_bench_without_a_tokenizer_is_refused_before_it_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    # It once started the stub and the sidecar, then failed looking for a model named
    # "None" online: the chat prompts are built with the tokenizer's chat template.
    with pytest.raises(SystemExit) as exit_info:
        main(["--pace", "engine", "--chat-tokens", "2500"])
    assert exit_info.value.code == 2
    assert "--chat-tokens needs --tokenizer" in capsys.readouterr().err


def test_the_relay_bench_times_only_complete_relayed_streams() -> None:
    """`perf.sidecar relay` compares reading a stream directly with reading it through
    the sidecar's relay; it refuses to report when the relay did not deliver every
    chunk's bytes (a failing exchange costs little CPU and would read as a fast relay)."""
    result = asyncio.run(measure_relay(chunks=4, requests=16, rounds=1))
    assert result["relayed_us"] > 0 and result["direct_us"] > 0
