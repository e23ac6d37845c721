"""Queueing in the sidecar, end to end over HTTP against a stub engine: a request that
cannot be admitted waits, is admitted when a slot frees (and says how long it waited),
leaves the queue when its client goes, and is refused only past its tier's bound."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from .conftest import Harness, StubFactory
from .helpers import WAIT, Keys, http_get, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine


def _post(url: str, token: str, **kwargs: Any) -> httpx.Response:
    return http_post(url + "/v1/completions",
                     json={"prompt": "x", "max_tokens": 1, "stream": True},
                     headers={"Authorization": f"Bearer {token}"}, **kwargs)


def _in_background(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _slot_taken(
    stub_sidecar: StubFactory, keys: Keys, head_delay: float = 0.0, **limits: Any
) -> tuple[Harness, StubEngine, str, threading.Thread, list[Any]]:
    """A sidecar whose tenant's one concurrency slot is held by a stream that goes on
    until the test calls `stub.release()`."""
    harness, stub = stub_sidecar(StubEngine(chunks=3, hold=threading.Event(),
                                            head_delay=head_delay))
    harness.apply(make_policy(tenant("acme", max_concurrent_requests=1, **limits)))
    token = keys.hs("acme")
    first, first_out = _in_background(lambda: _post(harness.url, token, timeout=30))
    wait_for(lambda: stub.active == 1, WAIT, "the first request never reached the engine")
    return harness, stub, token, first, first_out


def test_a_queued_request_is_admitted_when_the_slot_frees(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub, token, first, first_out = _slot_taken(stub_sidecar, keys)
    second, second_out = _in_background(lambda: _post(harness.url, token, timeout=30))
    wait_for(lambda: harness.gateway.queue.depth("acme") == 1, WAIT, "second never queued")
    queued_by = time.monotonic()
    status = http_get(harness.admin_url + "/kvquota/status").json()
    assert status["tenants"]["acme"]["usage"]["queued"] == 1
    metrics = http_get(harness.admin_url + "/metrics").text
    assert 'kvquota_tenant_queued_requests{tenant_id="acme"} 1.0' in metrics
    assert stub.active == 1  # the engine never saw two at once
    released_at = time.monotonic()
    stub.release()
    first.join(30), second.join(30)
    (first_reply,), (second_reply,) = first_out, second_out
    assert first_reply.status_code == second_reply.status_code == 200
    assert int(first_reply.headers["x-kvquota-queue-ms"]) == 0
    # It waited at least from when it was seen queued until the first stream was let
    # go (the sidecar runs in this process: one monotonic clock; the header rounds to
    # the millisecond, hence the 1 ms).
    waited_ms = (released_at - queued_by) * 1000
    assert int(second_reply.headers["x-kvquota-queue-ms"]) >= waited_ms - 1
    assert len(stub.received) == 2 and harness.wait_ledger_empty()
    assert harness.gateway.queue.depth("acme") == 0


def _server_timing(reply: httpx.Response) -> dict[str, float]:
    entries = (e.strip() for value in reply.headers.get_list("server-timing")
               for e in value.split(","))
    return {name: float(dur) for name, dur in (e.split(";dur=") for e in entries)}


def test_an_admitted_response_says_where_the_sidecars_time_went(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """Server-Timing: `admit`, from the request's arrival to its forwarding (queue wait
    included), and `upstream`, from forwarding until the engine's response head."""
    head_delay = 0.2
    harness, stub, token, first, first_out = _slot_taken(stub_sidecar, keys, head_delay)
    second, second_out = _in_background(lambda: _post(harness.url, token, timeout=30))
    wait_for(lambda: harness.gateway.queue.depth("acme") == 1, WAIT, "second never queued")
    queued_by = time.monotonic()
    time.sleep(0.1)  # a queue wait of its own, beside the engine's head delay
    released_at = time.monotonic()
    stub.release()
    first.join(30), second.join(30)
    (first_reply,), (second_reply,) = first_out, second_out
    first_timing, second_timing = _server_timing(first_reply), _server_timing(second_reply)
    assert set(first_timing) == set(second_timing) == {"admit", "upstream"}
    # Lower bounds only, from sleeps (the stub's head delay, this test's wait) on the
    # sidecar's own clock; 1 ms for the sleeps' timer granularity and the rounding.
    for timing in (first_timing, second_timing):
        assert timing["upstream"] >= head_delay * 1000 - 1
    assert second_timing["admit"] >= (released_at - queued_by) * 1000 - 1
    assert second_timing["admit"] >= int(second_reply.headers["x-kvquota-queue-ms"]) - 1
    assert "server-timing" not in stub.received_headers[0]  # ours, not the engine's


def test_a_client_that_gives_up_while_queued_leaves_no_trace(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub, token, first, _ = _slot_taken(stub_sidecar, keys)
    gone, gone_out = _in_background(lambda: _post(harness.url, token, timeout=0.5))
    gone.join(10)
    assert isinstance(gone_out[0], httpx.TimeoutException)
    wait_for(lambda: harness.gateway.queue.depth("acme") == 0, WAIT, "still queued")
    stub.release()
    first.join(30)
    assert harness.wait_ledger_empty()
    assert len(stub.received) == 1  # the abandoned request never reached the engine


def test_past_the_tiers_bound_a_queued_request_is_refused_with_retry_after(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub, token, first, _ = _slot_taken(stub_sidecar, keys, max_queue_seconds=0.5)
    started = time.monotonic()
    refused = _post(harness.url, token, timeout=30)
    waited = time.monotonic() - started
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "TENANT_CONCURRENCY_EXHAUSTED"
    assert int(refused.headers["retry-after"]) >= 1
    assert waited >= 0.5  # it did wait its bound first
    stub.release()
    first.join(30)
    assert harness.wait_ledger_empty() and len(stub.received) == 1
