"""The engine is marked down when the engine fails, not when the sidecar runs out of
file descriptors (at a 160-fd limit the engine was wrongly marked down)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
from collections.abc import Iterator

import httpx

from engine_sidecar.gateway.upstream.engine_monitor import EngineMonitor

from .conftest import StubFactory
from .helpers import WAIT, Keys, http_get, make_policy, tenant, wait_for


def _failing(exc: Exception) -> httpx.AsyncClient:
    def handler(_request: httpx.Request) -> httpx.Response:
        raise exc

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://e")


def _connect_error(cause: OSError) -> httpx.ConnectError:
    try:
        raise httpx.ConnectError("connect failed") from cause
    except httpx.ConnectError as error:
        return error


async def test_a_probe_failing_for_want_of_descriptors_keeps_the_engine_up() -> None:
    monitor = EngineMonitor()
    monitor.up, monitor.error = True, None
    emfile = OSError(errno.EMFILE, "Too many open files")
    async with _failing(_connect_error(emfile)) as client:
        assert await monitor.probe(client) is True
    assert monitor.up and monitor.error is None
    assert monitor.local_error is not None and "EMFILE" in monitor.local_error
    refused = OSError(errno.ECONNREFUSED, "Connection refused")
    async with _failing(_connect_error(refused)) as client:
        assert await monitor.probe(client) is False
    assert not monitor.up and monitor.error == "engine unreachable (ConnectError)"


@contextlib.contextmanager
def _no_more_descriptors() -> Iterator[None]:
    """Lower this process's descriptor limit to its lowest free descriptor: the next
    socket() or accept() fails with EMFILE, as at the sidecar's limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # the kernel hands out the lowest free descriptor
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_request_failing_at_the_descriptor_limit_does_not_mark_the_engine_down(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar(engine_probe_interval=30.0)  # no periodic probe meanwhile
    harness.apply(make_policy(tenant("acme")))
    body = b'{"prompt": "x", "max_tokens": 1}'
    head = ("POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n"
            f"Authorization: Bearer {keys.hs('acme')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    connections = harness.server.server.server_state.connections
    with socket.create_connection(("127.0.0.1", harness.server.port), timeout=10) as sock:
        wait_for(lambda: len(connections) == 1, WAIT, "the sidecar did not accept")
        with _no_more_descriptors():  # the sidecar cannot open a socket to the engine
            sock.sendall(head + body)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503"), answer
    assert harness.gateway.monitor.up, harness.gateway.monitor.error
    assert http_get(harness.admin_url + "/readyz").json()["ready"] is True
