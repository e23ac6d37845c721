"""The client port's /metrics: vLLM's own series, then the sidecar's picker signals.

An endpoint picker scrapes one URL per pod (the InferencePool's target port, which the
injected sidecar owns) and parses it as one exposition. So the sidecar reads vLLM's
whole answer (small: a few hundred series) and appends `picker_signals` to it in the
same text format, with a Content-Length of its own; vLLM's series pass untouched.

vLLM is asked for the classic text format whatever the scraper accepts: an OpenMetrics
answer ends with `# EOF`, after which nothing may follow. Compression is never asked
for upstream (`relay.exchange.REQUEST_DROP`), so the body can be extended. Engine
failures are answered as on every passed-through route (502/503/504, nothing internal).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Scope, Send

from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.relay.exchange import (
    RESPONSE_DROP,
    Upstream,
    filter_headers,
    read_capped,
    request_headers,
    send_error,
)

TEXT_FORMAT = b"text/plain; version=0.0.4; charset=utf-8"
MAX_ENGINE_METRICS_BYTES = 16 * 1024 * 1024
_REPLACED = RESPONSE_DROP | {b"content-length", b"content-type"}


async def serve_metrics(
    scope: Scope, send: Send, upstream: Upstream, signals: Callable[[], bytes]
) -> None:
    """GET /metrics from the engine, with `signals()` appended to a 200 answer."""
    query = scope.get("query_string") or b""
    target = "/metrics" + ("?" + query.decode("latin-1") if query else "")
    headers = [(k, v) for k, v in request_headers(scope["headers"]) if k != b"accept"]
    headers.append((b"accept", TEXT_FORMAT))
    try:
        status, raw_headers, body = await _engine_metrics(upstream, target, headers)
    except ApiError as error:
        await send_error(send, error)
        return
    content_type = next((v for k, v in raw_headers if k.lower() == b"content-type"),
                        TEXT_FORMAT)
    encoded = any(k.lower() == b"content-encoding" for k, _ in raw_headers)
    if status == 200 and not encoded and content_type.startswith(b"text/plain"):
        if body and not body.endswith(b"\n"):
            body += b"\n"
        body += signals()
    out = [*filter_headers(raw_headers, _REPLACED), (b"content-type", content_type),
           (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _engine_metrics(
    upstream: Upstream, target: str, headers: list[tuple[bytes, bytes]]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    response = await upstream.open("GET", target, headers, b"")
    try:
        if response.status_code >= 500:
            raise upstream.failure_status(response.status_code)
        body = await read_capped(response, MAX_ENGINE_METRICS_BYTES, "/metrics")
        return response.status_code, response.raw_headers, body
    except OSError as exc:
        raise upstream.failure(exc) from None
    finally:
        await response.aclose()
