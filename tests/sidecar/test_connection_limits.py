"""What one connection may hold: head and body deadlines, auth before the body, the
body cap, and the connection limit. Raw sockets against the sidecar as `kvquota
sidecar` serves it (the guarded protocol), in front of the stub engine.

Deadlines here are short (1 s) so the tests are quick; every "cut off within" bound
adds MARGIN_S for a loaded two-core machine (timer and thread scheduling). A server
without the deadline never closes, so the margin decides nothing but speed.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

from engine_sidecar.gateway.server import ConnectionLimits

from .conftest import Harness, StubFactory
from .helpers import WAIT, Keys, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

DEADLINE_S = 1.0
MARGIN_S = 3.0
MIB = 1024 * 1024


def _connect(harness: Harness) -> socket.socket:
    return socket.create_connection(("127.0.0.1", harness.server.port), timeout=10)


def _head(path: str, *headers: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: sidecar", "Content-Type: application/json",
             *headers]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _trickle(sock: socket.socket, payload: bytes, give_up_after: float) -> tuple[bytes, bool]:
    """Send `payload` a byte every 0.2 s (then keep the line open) while reading.
    Returns what the server answered and whether it closed the connection."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + give_up_after
    pending = payload
    while time.monotonic() < deadline:
        if pending:
            try:
                sock.send(pending[:1])
            except OSError:  # reset: the server closed
                return received, True
            pending = pending[1:]
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed within `timeout`."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        pass
    return received, True


def _status(response: bytes) -> int | None:
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else None


def test_a_client_trickling_its_headers_gets_408_and_is_closed(
    stub_sidecar: StubFactory,
) -> None:
    harness, stub = stub_sidecar(limits=ConnectionLimits(head_timeout=DEADLINE_S))
    with _connect(harness) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n"
                     b"X-Request-Id: slow-1\r\n")
        answer, closed = _trickle(sock, b"X-Slow: " + b"a" * 200, DEADLINE_S + MARGIN_S)
        elapsed = time.monotonic() - started
    assert closed, f"still open after {elapsed:.1f}s"
    assert _status(answer) == 408, answer
    assert b"REQUEST_TIMEOUT" in answer
    assert b"\r\nx-request-id: slow-1\r\n" in answer  # the client's, from what came
    assert DEADLINE_S * 0.9 <= elapsed <= DEADLINE_S + MARGIN_S
    assert not stub.received


def test_idle_and_kept_alive_connections_are_held_no_longer_than_the_deadline(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """A connection that never sends, and the next request on a kept-alive one."""
    harness, _ = stub_sidecar(limits=ConnectionLimits(head_timeout=DEADLINE_S,
                                                      keep_alive_timeout=60))
    harness.apply(make_policy(tenant("acme")))
    with _connect(harness) as idle:
        answer, closed = _read_until_closed(idle, DEADLINE_S + MARGIN_S)
    assert closed and answer == b""  # nothing was asked: nothing to answer
    body = b'{"prompt": "x", "max_tokens": 1}'
    with _connect(harness) as sock:
        sock.sendall(_head("/v1/completions", f"Authorization: Bearer {keys.hs('acme')}",
                           length=len(body)) + body)
        sock.settimeout(10)
        first = sock.recv(65536)
        assert _status(first) == 200, first
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # the next one, slowly
        answer, closed = _trickle(sock, b"Host: " + b"a" * 200, DEADLINE_S + MARGIN_S)
    assert closed and _status(answer) == 408, answer


def test_an_oversized_head_is_431(stub_sidecar: StubFactory) -> None:
    harness, _ = stub_sidecar(limits=ConnectionLimits(max_head_bytes=8 * 1024))
    with _connect(harness) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 32 * 1024)
        answer, closed = _read_until_closed(sock, 10)
    assert closed and _status(answer) == 431, answer
    assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", answer), answer  # a new one


def test_a_request_that_is_not_http_gets_the_sidecars_400_with_a_request_id(
    stub_sidecar: StubFactory,
) -> None:
    """httptools cannot parse it, so it never reaches the app; the answer is the
    sidecar's JSON 400 and still carries an x-request-id (a new one: the parser stops
    before it hands over the headers it has read)."""
    harness, stub = stub_sidecar()
    for garbage in (b"GET /healthz HTTP/1.1\r\nX-Request-Id: bad-1\r\nNo colon\r\n\r\n",
                    b"\x16\x03\x01 not http\r\n\r\n"):  # a header without a colon; TLS
        with _connect(harness) as sock:
            sock.sendall(garbage)
            answer, closed = _read_until_closed(sock, 10)
        assert closed and _status(answer) == 400, answer
        assert b'"code":"INVALID_REQUEST"' in answer
        assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", answer), answer
    assert not stub.received


def test_a_client_trickling_its_body_gets_408_and_is_closed(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub = stub_sidecar(body_timeout=DEADLINE_S)
    harness.apply(make_policy(tenant("acme")))
    with _connect(harness) as sock:
        sock.sendall(_head("/v1/completions", f"Authorization: Bearer {keys.hs('acme')}",
                           length=1000) + b'{"prompt": ')
        started = time.monotonic()
        answer, closed = _trickle(sock, b'"' + b"a" * 900, DEADLINE_S + MARGIN_S)
        elapsed = time.monotonic() - started
    assert closed, f"still open after {elapsed:.1f}s"
    assert _status(answer) == 408, answer
    assert elapsed <= DEADLINE_S + MARGIN_S
    assert not stub.received
    assert harness.ledger_is_empty()


def test_an_unauthenticated_body_is_refused_before_it_is_read(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """The sidecar answers while almost all of a 30 MiB body is still unsent, so it
    cannot have buffered it; and it closes, so the client cannot go on sending."""
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme")))
    cases = {401: [], 403: [f"Authorization: Bearer {keys.hs('stranger')}"]}
    for status, credentials in cases.items():
        with _connect(harness) as sock:
            sock.sendall(_head("/v1/completions", *credentials, length=30 * MIB)
                         + b"a" * 64 * 1024)
            answer, closed = _read_until_closed(sock, 10)
        assert _status(answer) == status, answer
        assert closed, "the connection stayed open for the rest of the body"
    assert not stub.received


def test_a_body_over_the_tenants_cap_is_413_before_it_is_read(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """100 blocks of 32 tokens: no admissible prompt needs 1 MiB of JSON."""
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_blocks_per_engine=100)))
    with _connect(harness) as sock:
        sock.sendall(_head("/v1/completions", f"Authorization: Bearer {keys.hs('acme')}",
                           length=MIB))
        answer, closed = _read_until_closed(sock, 10)
    assert closed and _status(answer) == 413, answer
    assert b"REQUEST_TOO_LARGE" in answer and not stub.received
    # Without a declared length (chunked), the cap holds while reading.
    chunks = (b'{"prompt": "' + b"a" * 400 * 1024 + b'"}' for _ in range(1))
    response = http_post(harness.url + "/v1/completions", content=chunks,
                         headers={"Authorization": f"Bearer {keys.hs('acme')}"})
    assert response.status_code == 413 and not stub.received


def test_beyond_the_connection_limit_new_requests_get_a_fast_503(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """Four connections: one streaming request, three idle ones. A fifth is refused at
    once (not after the 30 s head deadline); the stream finishes unharmed."""
    harness, stub = stub_sidecar(StubEngine(chunks=3, hold=threading.Event()),
                                 limits=ConnectionLimits(max_connections=4, head_timeout=30))
    harness.apply(make_policy(tenant("acme")))
    headers = {"Authorization": f"Bearer {keys.hs('acme')}"}
    url = harness.url + "/v1/completions"
    streamed: list[httpx.Response] = []

    def stream() -> None:
        streamed.append(http_post(url, json={"prompt": "x", "stream": True},
                                  headers=headers, timeout=30))

    worker = threading.Thread(target=stream)
    worker.start()
    wait_for(lambda: stub.active == 1, WAIT, "the stream never reached the engine")
    connections = harness.server.server.server_state.connections
    idle = [_connect(harness) for _ in range(3)]
    try:
        wait_for(lambda: len(connections) == 4, WAIT, "the idle connections were not accepted")
        started = time.monotonic()
        refused = http_post(url, json={"prompt": "x"}, timeout=10,
                            headers={**headers, "X-Request-Id": "over-the-limit-1"})
        elapsed = time.monotonic() - started
        assert refused.status_code == 503, refused.text
        # The sidecar's own refusal, not uvicorn's plain text: OpenAI's shape, the id.
        assert refused.json()["error"]["code"] == "TOO_MANY_CONNECTIONS"
        assert refused.headers["x-request-id"] == "over-the-limit-1"
        assert refused.headers["retry-after"] == "1"
        assert elapsed < 5, f"the refusal took {elapsed:.1f}s"
    finally:
        stub.release()
        worker.join(30)
        for sock in idle:
            sock.close()
    (done,) = streamed
    assert done.status_code == 200 and done.text.endswith("data: [DONE]\n\n")
    wait_for(lambda: len(connections) == 0, WAIT, "connections were not closed")
    assert http_post(url, json={"prompt": "x"}, headers=headers).status_code == 200
    assert harness.wait_ledger_empty()
