"""OpenTelemetry spans for the sidecar's request path, only when asked for.

With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, the
OpenTelemetry convention, `instrument_from_env` exports over OTLP/HTTP (the `tracing`
extra) and each generation request gets:

- `kvquota.request` (server): the whole request, child of the client's `traceparent`;
- `kvquota.auth`: authentication, with the tenant or the refusal;
- `kvquota.admission`: counting, queueing and the decision (`kvquota.decision`,
  `kvquota.blocks`, `kvquota.tier`, `kvquota.queue_wait_ms`);
- `kvquota.queue_wait`: the time spent in the tenant's queue, when it had to wait;
- `kvquota.upstream` (client): the call to vLLM, from sending to the last byte, whose
  context goes to vLLM as `traceparent`, so vLLM's own spans
  (`--otlp-traces-endpoint`) hang below it.

Without the variable nothing here is installed: the gateway's methods are the plain
ones and a request pays nothing. Instrumentation wraps the gateway's own steps on the
instance (`instrument`), so the request path in app.py carries no tracing code.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission import Decision
from engine_sidecar.gateway.errors import ApiError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from engine_sidecar.gateway.admission_queue import Ticket
    from engine_sidecar.gateway.app import Gateway

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SERVICE_NAME = "kvquota-sidecar"
TRACE_HEADERS = (b"traceparent", b"tracestate")
INSTRUMENTATION = "engine_sidecar.gateway"


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


def instrument_from_env(gateway: Gateway) -> bool:
    """Instrument `gateway` when an OTLP endpoint is configured; True if it was."""
    if not enabled():
        return False
    provider = provider_from_env()
    if provider is None:
        return False
    instrument(gateway, provider)
    logger.info("tracing: spans exported over OTLP")
    return True


@dataclass
class _RequestTrace:
    """What one request's spans share (held in a context variable: one task each)."""

    ticket: Ticket | None = None
    upstream: Span | None = None
    status: int | None = None


_CURRENT: contextvars.ContextVar[_RequestTrace | None] = contextvars.ContextVar(
    "kvquota_request_trace", default=None)


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw
            if k.lower() in TRACE_HEADERS}


def _refusal(span: Span, error: ApiError) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("kvquota.refusal", error.code)
    span.set_attribute("http.response.status_code", error.status)
    span.set_status(Status(StatusCode.ERROR, error.code))


def instrument(gateway: Gateway, provider: Any) -> None:
    """Wrap the gateway's request steps in spans from `provider`'s tracer."""
    tracer = provider.get_tracer(INSTRUMENTATION)
    _wrap_generate(gateway, tracer)
    _wrap_authenticate(gateway, tracer)
    _wrap_admit(gateway, tracer)
    _wrap_queue(gateway, tracer)
    _wrap_upstream(gateway, tracer)


def _wrap_generate(gateway: Gateway, tracer: Tracer) -> None:
    from opentelemetry import context, propagate, trace

    original = gateway._generate

    @functools.wraps(original)
    async def generate(scope: Any, receive: Any, send: Any, kind: Any) -> None:
        parent = propagate.extract(_headers(scope["headers"]))
        state = _RequestTrace()
        span = tracer.start_span("kvquota.request", context=parent,
                                 kind=trace.SpanKind.SERVER,
                                 attributes={"http.request.method": scope["method"],
                                             "url.path": scope["path"]})
        token = context.attach(trace.set_span_in_context(span, parent))
        reset = _CURRENT.set(state)

        async def recording_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                state.status = message["status"]
            await send(message)

        try:
            await original(scope, receive, recording_send, kind)
        finally:
            if state.upstream is not None:
                state.upstream.set_attribute("http.response.status_code", state.status or 0)
                state.upstream.end()
            if state.status is not None:
                span.set_attribute("http.response.status_code", state.status)
            span.end()
            _CURRENT.reset(reset)
            context.detach(token)

    gateway._generate = generate  # type: ignore[method-assign]


def _wrap_authenticate(gateway: Gateway, tracer: Tracer) -> None:
    original = gateway._authenticate

    @functools.wraps(original)
    def authenticate(active: Any, headers: Any) -> str:
        with tracer.start_as_current_span("kvquota.auth", record_exception=False,
                                          set_status_on_exception=False) as span:
            try:
                tenant_id = original(active, headers)
            except ApiError as error:
                _refusal(span, error)
                raise
            span.set_attribute("kvquota.tenant", tenant_id)
            return tenant_id

    gateway._authenticate = authenticate  # type: ignore[method-assign]


def _wrap_admit(gateway: Gateway, tracer: Tracer) -> None:
    original = gateway._admit

    @functools.wraps(original)
    async def admit(*args: Any) -> Any:
        state = _CURRENT.get()
        with tracer.start_as_current_span("kvquota.admission", record_exception=False,
                                          set_status_on_exception=False) as span:
            try:
                admitted = await original(*args)
            except ApiError as error:
                _refusal(span, error)
                if error.code == errors.PROMPT_TOO_LONG:  # refused by its size, untokenized
                    span.set_attribute("kvquota.decision", str(Decision.REJECTED_PROMPT))
                raise
            finally:
                _describe_decision(span, state.ticket if state else None)
            if admitted is None:
                span.set_attribute("kvquota.decision", "client_left")
            return admitted

    gateway._admit = admit  # type: ignore[method-assign,assignment]


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


def _wrap_queue(gateway: Gateway, tracer: Tracer) -> None:
    submit, wait = gateway.queue.submit, gateway._wait_in_queue

    @functools.wraps(submit)
    def submitting(tenant_id: str, shape: Any, payload: Any = None) -> Ticket:
        ticket = submit(tenant_id, shape, payload)
        state = _CURRENT.get()
        if state is not None:
            state.ticket = ticket
        return ticket

    @functools.wraps(wait)
    async def waiting(ticket: Ticket, receive: Any) -> bool:
        with tracer.start_as_current_span("kvquota.queue_wait") as span:
            span.set_attribute("kvquota.tenant", ticket.tenant_id)
            stayed = await wait(ticket, receive)
            span.set_attribute("kvquota.outcome", "settled" if stayed else "client_left")
            if ticket.waited_on is not None:
                span.set_attribute("kvquota.waited_on", str(ticket.waited_on))
            return stayed

    gateway.queue.submit = submitting  # type: ignore[method-assign]
    gateway._wait_in_queue = waiting  # type: ignore[method-assign]


def _wrap_upstream(gateway: Gateway, tracer: Tracer) -> None:
    from opentelemetry import propagate, trace

    upstream = gateway.upstream
    original: Callable[..., Any] = upstream.open

    @functools.wraps(original)
    async def open_(method: str, path: str, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> Any:
        state = _CURRENT.get()
        span = tracer.start_span("kvquota.upstream", kind=trace.SpanKind.CLIENT,
                                 attributes={"http.request.method": method,
                                             "url.full": f"{upstream.client.base_url}{path}"})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        sent = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
        sent += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        started = time.monotonic()
        try:
            response = await original(method, path, sent, body)
        except BaseException as error:
            span.record_exception(error)
            span.end()
            raise
        span.set_attribute("kvquota.upstream_headers_ms",
                           round((time.monotonic() - started) * 1000, 3))
        if state is not None and state.upstream is None:
            state.upstream = span  # ends with the request: the stream is part of the call
        else:
            span.set_attribute("http.response.status_code", response.status_code)
            span.end()
        return response

    upstream.open = open_  # type: ignore[method-assign]
