"""Sidecar spans, recorded by the OpenTelemetry SDK's in-memory exporter, for requests
sent over HTTP to a sidecar in front of the recording stub engine (which shows the
`traceparent` vLLM would receive)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine_sidecar.gateway.admission.queue import Ticket
from engine_sidecar.gateway.app import Gateway, GatewayConfig
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.telemetry import tracing
from engine_sidecar.gateway.telemetry.observer import NO_OBSERVER, NO_TRACE, RequestTrace

from .conftest import Harness, StubFactory
from .helpers import WAIT, Keys, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine
from .test_queueing import _in_background, _post

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def _traced(stub_sidecar: StubFactory, exporter: InMemorySpanExporter,
            stub: StubEngine | None = None, **limits: object) -> tuple[Harness, StubEngine]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    harness, stub = stub_sidecar(stub, observer=tracing.SpanObserver(provider))
    harness.apply(make_policy(tenant("acme", **limits)))
    return harness, stub


def _spans(exporter: InMemorySpanExporter, count: int) -> dict[str, list[ReadableSpan]]:
    """Spans by name, once `count` have ended (the request span ends after the client
    has its last byte)."""
    wait_for(lambda: len(exporter.get_finished_spans()) >= count, 5,
             f"expected {count} spans, got {exporter.get_finished_spans()}")
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def test_an_admitted_request_is_traced_from_the_client_to_vllm(
    stub_sidecar: StubFactory, keys: Keys, exporter: InMemorySpanExporter
) -> None:
    harness, stub = _traced(stub_sidecar, exporter)
    response = http_post(harness.url + "/v1/completions",
                         json={"prompt": "tenant quota cache", "max_tokens": 4},
                         headers={"Authorization": f"Bearer {keys.hs('acme')}",
                                   "traceparent": CLIENT_PARENT})
    assert response.status_code == 200, response.text
    spans = _spans(exporter, 4)
    (request,), (auth,), (admission,), (upstream,) = (
        spans["kvquota.request"], spans["kvquota.auth"], spans["kvquota.admission"],
        spans["kvquota.upstream"])
    assert "kvquota.queue_wait" not in spans  # admitted at once: it never queued

    # One trace, the client's: request under the client's span, the steps under it.
    assert {_hex(s.context.trace_id, 32) for s in (request, auth, admission, upstream)} == {
        CLIENT_TRACE}
    assert request.parent is not None and _hex(request.parent.span_id, 16) == CLIENT_SPAN
    assert request.kind is SpanKind.SERVER and upstream.kind is SpanKind.CLIENT
    for step in (auth, admission, upstream):
        assert step.parent is not None and step.parent.span_id == request.context.span_id
    assert request.attributes["http.response.status_code"] == 200
    # Every span names the request as its answer does (x-request-id).
    assert {s.attributes["kvquota.request_id"] for s in (request, auth, admission, upstream)
            } == {response.headers["x-request-id"]}
    assert auth.attributes["kvquota.tenant"] == "acme"
    assert admission.attributes["kvquota.decision"] == "admitted"
    assert admission.attributes["kvquota.blocks"] >= 1
    assert auth.end_time <= admission.start_time and admission.end_time <= upstream.start_time

    # vLLM gets the upstream span as its parent, in the client's trace.
    (sent,) = stub.received_headers
    assert sent["traceparent"] == (
        f"00-{CLIENT_TRACE}-{_hex(upstream.context.span_id, 16)}-01")


def test_a_refused_request_says_why_and_never_reaches_the_engine(
    stub_sidecar: StubFactory, keys: Keys, exporter: InMemorySpanExporter
) -> None:
    harness, stub = _traced(stub_sidecar, exporter, max_prompt_tokens=2)
    response = http_post(harness.url + "/v1/completions",
                         json={"prompt": "far too many words for this tenant", "max_tokens": 4},
                         headers={"Authorization": f"Bearer {keys.hs('acme')}"})
    assert response.status_code == 400, response.text
    spans = _spans(exporter, 3)
    (admission,) = spans["kvquota.admission"]
    assert admission.attributes["kvquota.decision"] == "rejected_prompt"
    assert admission.attributes["http.response.status_code"] == 400
    assert admission.status.status_code is StatusCode.ERROR
    assert "kvquota.upstream" not in spans and stub.received == []


def test_a_bad_token_ends_in_the_auth_span(
    stub_sidecar: StubFactory, keys: Keys, exporter: InMemorySpanExporter
) -> None:
    harness, _stub = _traced(stub_sidecar, exporter)
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers={"Authorization": "Bearer not-a-token"})
    assert response.status_code == 401
    spans = _spans(exporter, 2)
    (auth,) = spans["kvquota.auth"]
    assert auth.status.status_code is StatusCode.ERROR
    assert auth.attributes["http.response.status_code"] == 401
    assert "kvquota.tenant" not in auth.attributes
    assert set(spans) == {"kvquota.request", "kvquota.auth"}


def test_queue_wait_is_a_span_of_its_own(
    stub_sidecar: StubFactory, keys: Keys, exporter: InMemorySpanExporter
) -> None:
    harness, stub = _traced(stub_sidecar, exporter, StubEngine(chunks=3, hold=threading.Event()),
                            max_concurrent_requests=1)
    token = keys.hs("acme")
    first, _ = _in_background(lambda: _post(harness.url, token, timeout=30))
    wait_for(lambda: stub.active == 1, WAIT, "the first request never reached the engine")
    second, second_out = _in_background(lambda: _post(harness.url, token, timeout=30))
    wait_for(lambda: harness.gateway.queue.depth("acme") == 1, WAIT, "second never queued")
    stub.release()
    first.join(30), second.join(30)
    assert second_out[0].status_code == 200
    spans = _spans(exporter, 9)
    (wait,) = spans["kvquota.queue_wait"]
    queued = next(s for s in spans["kvquota.admission"]
                  if s.context.span_id == (wait.parent.span_id if wait.parent else None))
    assert queued.attributes["kvquota.decision"] == "admitted"
    assert wait.attributes["kvquota.waited_on"] == "rejected_concurrency"
    # The span starts after the ticket arrived and ends after it settled, so it holds at
    # least the wait the response header reports (rounded to the millisecond: 1 ms).
    waited_ms = int(second_out[0].headers["x-kvquota-queue-ms"])
    assert waited_ms > 0
    assert (wait.end_time - wait.start_time) / 1e6 >= waited_ms - 1
    assert queued.start_time <= wait.start_time and wait.end_time <= queued.end_time


def _patched(gateway: Gateway) -> list[str]:
    """Methods replaced on an instance of the gateway or of one of its parts."""
    parts = (gateway, gateway.intake, gateway.admitter, gateway.relay, gateway.upstream,
             gateway.queue, gateway.passthrough)
    return [f"{type(part).__name__}.{name}" for part in parts for name in vars(part)
            if callable(getattr(type(part), name, None))]


def test_without_an_endpoint_nothing_is_instrumented(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    gateway = Gateway(GatewayConfig(), None)
    # Every request gets the empty trace: no spans, nothing wrapped, no per-chunk cost.
    assert gateway.observer is NO_OBSERVER
    assert gateway.observer.request({"headers": []}) is NO_TRACE
    assert _patched(gateway) == []


def test_an_endpoint_turns_tracing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    gateway = Gateway(GatewayConfig(), None)
    assert isinstance(gateway.observer, tracing.SpanObserver)
    assert _patched(gateway) == []  # spans come from the observer, not from wrappers


class _Recording(RequestTrace):
    """A trace that writes down the hooks the gateway calls, in order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def auth_started(self) -> None:
        self.calls.append("auth")

    def auth_ended(self, tenant_id: str | None, error: ApiError | None) -> None:
        self.calls.append(f"auth_ended:{tenant_id or (error and error.status)}")

    def admission_started(self) -> None:
        self.calls.append("admission")

    def queued(self, ticket: Ticket) -> None:
        self.calls.append(f"queued:{ticket.tenant_id}")

    def admission_ended(self, error: ApiError | None, left: bool) -> None:
        self.calls.append(f"admission_ended:{error.status if error else 'left' if left else 'ok'}")

    def upstream_started(self, method: str, base_url: str, path: str,
                         headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        self.calls.append(f"upstream:{method} {path}")
        return [*headers, (b"x-observed", b"1")]

    def upstream_opened(self) -> None:
        self.calls.append("upstream_opened")

    def ended(self, status: int | None) -> None:
        self.calls.append(f"ended:{status}")


def test_the_observer_hears_each_step_of_a_generation_request_and_nothing_else(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    calls: list[str] = []

    class Observer:
        def request(self, scope: Any) -> RequestTrace:
            calls.append(f"request:{scope['path']}")
            return _Recording(calls)

    def heard() -> list[str]:
        """The calls, once the request ended (after the client has its last byte)."""
        wait_for(lambda: calls and calls[-1].startswith("ended:"), WAIT, f"{calls}")
        return calls

    harness, stub = stub_sidecar(observer=Observer())
    harness.apply(make_policy(tenant("acme", max_prompt_tokens=3)))
    auth = {"Authorization": f"Bearer {keys.hs('acme')}"}
    assert http_post(harness.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                     headers=auth).status_code == 200
    assert heard() == ["request:/v1/completions", "auth", "auth_ended:acme", "admission",
                       "queued:acme", "admission_ended:ok", "upstream:POST /v1/completions",
                       "upstream_opened", "ended:200"]
    # The engine got the headers the trace returned.
    assert stub.received_headers[0]["x-observed"] == "1"
    calls.clear()
    assert http_post(harness.url + "/v1/completions",
                     json={"prompt": "far too many words here", "max_tokens": 2},
                     headers=auth).status_code == 400
    assert heard() == ["request:/v1/completions", "auth", "auth_ended:acme", "admission",
                       "queued:acme", "admission_ended:400", "ended:400"]  # the queue refused
    calls.clear()
    assert http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                     headers={"Authorization": "Bearer nope"}).status_code == 401
    assert heard() == ["request:/v1/completions", "auth", "auth_ended:401", "ended:401"]
    calls.clear()
    assert http_post(harness.url + "/tokenize", json={"prompt": "x"},
                     headers=auth).status_code == 200
    assert calls == []  # not a generation request
