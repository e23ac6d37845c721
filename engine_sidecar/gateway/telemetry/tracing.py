"""OpenTelemetry spans for the sidecar's request path, only when asked for.

With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set,
`observer_from_env` returns a `SpanObserver` that exports over OTLP/HTTP (the `tracing`
extra): `kvquota.request`, `kvquota.auth`, `kvquota.admission`, `kvquota.queue_wait`
and `kvquota.upstream`, whose context goes to vLLM as `traceparent` so vLLM's own spans
hang below it. Without the variable the gateway gets `observer.NO_OBSERVER`. The
observer is passed in at construction: nothing is wrapped or replaced. The spans and
their attributes: README, Tracing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import Scope

from engine_sidecar.gateway import errors, request_id
from engine_sidecar.gateway.admission.rules import Decision
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.telemetry.observer import NO_OBSERVER, Headers, Observer, RequestTrace

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from engine_sidecar.gateway.admission.queue import Ticket

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SERVICE_NAME = "kvquota-sidecar"
TRACE_HEADERS = (b"traceparent", b"tracestate")
INSTRUMENTATION = "engine_sidecar.gateway"
REQUEST_ID_ATTRIBUTE = "kvquota.request_id"  # on every span: the response's x-request-id


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(name) for name in ENDPOINT_VARIABLES)


def provider_from_env() -> TracerProvider | None:
    """An SDK provider exporting over OTLP/HTTP as the OTEL_* variables configure it;
    None (with a warning) when the `tracing` extra is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("%s is set but tracing needs the 'tracing' extra: "
                       "pip install 'kvquota[tracing]'; running without spans",
                       next(n for n in ENDPOINT_VARIABLES if os.environ.get(n)))
        return None
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def observer_from_env() -> Observer:
    """Spans exported over OTLP when an endpoint is configured, else no tracing."""
    if not enabled():
        return NO_OBSERVER
    provider = provider_from_env()
    if provider is None:
        return NO_OBSERVER
    logger.info("tracing: spans exported over OTLP")
    return SpanObserver(provider)


def _headers(raw: Headers) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw
            if k.lower() in TRACE_HEADERS}


def _refusal(span: Span, error: ApiError) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("kvquota.refusal", error.code)
    span.set_attribute("http.response.status_code", error.status)
    span.set_status(Status(StatusCode.ERROR, error.code))


class SpanObserver:
    """The gateway's observer when tracing: each generation request's spans, from
    `provider`'s tracer."""

    def __init__(self, provider: Any) -> None:
        self.tracer: Tracer = provider.get_tracer(INSTRUMENTATION)

    def request(self, scope: Scope) -> RequestTrace:
        return _SpanTrace(self.tracer, scope)


class _SpanTrace(RequestTrace):
    """One request's spans: the request's (current while the request runs), and one
    per step, each a child of the request's but the queue wait (the admission's)."""

    __slots__ = (
        "admission",
        "auth",
        "context",
        "request",
        "request_id",
        "ticket",
        "token",
        "tracer",
        "upstream",
        "upstream_sent",
        "wait",
    )

    def __init__(self, tracer: Tracer, scope: Scope) -> None:
        from opentelemetry import context, propagate, trace

        self.tracer = tracer
        self.request_id = request_id.of(scope) or ""
        parent = propagate.extract(_headers(scope["headers"]))
        self.request = tracer.start_span(
            "kvquota.request", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                        REQUEST_ID_ATTRIBUTE: self.request_id})
        self.context: Context = trace.set_span_in_context(self.request, parent)
        self.token = context.attach(self.context)
        self.ticket: Ticket | None = None
        self.auth: Span | None = None
        self.admission: Span | None = None
        self.wait: Span | None = None
        self.upstream: Span | None = None
        self.upstream_sent = 0.0

    def _child(self, name: str, parent: Span | None = None, **kwargs: Any) -> Span:
        from opentelemetry import trace

        context = self.context if parent is None else trace.set_span_in_context(parent)
        span = self.tracer.start_span(name, context=context, **kwargs)
        span.set_attribute(REQUEST_ID_ATTRIBUTE, self.request_id)
        return span

    def auth_started(self) -> None:
        self.auth = self._child("kvquota.auth")

    def auth_ended(self, tenant_id: str | None, error: ApiError | None) -> None:
        span, self.auth = self.auth, None
        assert span is not None
        if error is not None:
            _refusal(span, error)
        elif tenant_id is not None:
            span.set_attribute("kvquota.tenant", tenant_id)
        span.end()

    def admission_started(self) -> None:
        self.admission = self._child("kvquota.admission")

    def queued(self, ticket: Ticket) -> None:
        self.ticket = ticket

    def queue_wait_started(self) -> None:
        self.wait = self._child("kvquota.queue_wait", self.admission)
        if self.ticket is not None:
            self.wait.set_attribute("kvquota.tenant", self.ticket.tenant_id)

    def queue_wait_ended(self, stayed: bool) -> None:
        span, self.wait = self.wait, None
        assert span is not None
        span.set_attribute("kvquota.outcome", "settled" if stayed else "client_left")
        if self.ticket is not None and self.ticket.waited_on is not None:
            span.set_attribute("kvquota.waited_on", str(self.ticket.waited_on))
        span.end()

    def admission_ended(self, error: ApiError | None, left: bool) -> None:
        span, self.admission = self.admission, None
        assert span is not None
        if error is not None:
            _refusal(span, error)
            if error.code == errors.PROMPT_TOO_LONG:  # refused by its size, untokenized
                span.set_attribute("kvquota.decision", str(Decision.REJECTED_PROMPT))
        _describe_decision(span, self.ticket)
        if left:
            span.set_attribute("kvquota.decision", "client_left")
        span.end()

    def upstream_started(self, method: str, base_url: str, path: str,
                         headers: Headers) -> Headers:
        from opentelemetry import propagate, trace

        span = self.upstream = self._child(
            "kvquota.upstream", kind=trace.SpanKind.CLIENT,
            attributes={"http.request.method": method, "url.full": f"{base_url}{path}"})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        sent = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
        sent += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        self.upstream_sent = time.monotonic()
        return sent

    def upstream_opened(self) -> None:
        # The span ends with the request: the stream is part of the call.
        if self.upstream is not None:
            self.upstream.set_attribute(
                "kvquota.upstream_headers_ms",
                round((time.monotonic() - self.upstream_sent) * 1000, 3))

    def upstream_failed(self, error: BaseException) -> None:
        span, self.upstream = self.upstream, None
        if span is not None:
            span.record_exception(error)
            span.end()

    def ended(self, status: int | None) -> None:
        from opentelemetry import context

        for step in (self.auth, self.wait, self.admission):  # a step a bug cut short
            if step is not None:
                step.end()
        if self.upstream is not None:
            self.upstream.set_attribute("http.response.status_code", status or 0)
            self.upstream.end()
        if status is not None:
            self.request.set_attribute("http.response.status_code", status)
        self.request.end()
        context.detach(self.token)


def _describe_decision(span: Span, ticket: Ticket | None) -> None:
    if ticket is None or ticket.verdict is None:
        return
    decision = Decision.ADMITTED if ticket.admitted else ticket.verdict.decision
    span.set_attribute("kvquota.decision", str(decision))
    span.set_attribute("kvquota.blocks", ticket.verdict.blocks)
    span.set_attribute("kvquota.tenant", ticket.tenant_id)
    span.set_attribute("kvquota.queue_wait_ms", round(ticket.waited * 1000, 3))
    if ticket.waited_on is not None:
        span.set_attribute("kvquota.waited_on", str(ticket.waited_on))
