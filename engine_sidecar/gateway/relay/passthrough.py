"""vLLM's other routes through the sidecar, each handled as its cost warrants.

The sidecar owns the port clients, routers and scrapers already use, so every route
vLLM serves there must keep working. Generation (/v1/completions, /v1/chat/completions,
/v1/responses) is admitted elsewhere; here:
- `/health`, `/ping`, `/version`, `/metrics`: no credentials, not admitted (`/metrics`
  gets the picker signals appended, `metrics_scrape`);
- `/tokenize`, `/detokenize`: a tenant's credentials, not admitted (no KV blocks);
- `/v1/embeddings`: a tenant's credentials, tagged as admitted routes are (`priority`,
  `cache_salt`; `request_id` and `kv_transfer_params` dropped), not admitted: one
  forward pass, no decode. Bodies are capped as the tenant's; other routes get a 404.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.body import unread
from engine_sidecar.gateway.intake.body_checks import invalid
from engine_sidecar.gateway.intake.entry import Intake
from engine_sidecar.gateway.relay.exchange import Upstream, exchange, request_headers, send_error
from engine_sidecar.gateway.telemetry.metrics_scrape import serve_metrics

# Fields only the sidecar sets (clients' values are dropped or overwritten).
OWNED_FIELDS = ("priority", "cache_salt", "vllm_xargs", "request_id", "kv_transfer_params")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                     "/v1/models")
HEALTH_ROUTES = ("/healthz", "/readyz")


@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    credentials: bool
    tag: Callable[[dict[str, Any], Any, str, str | None], None] | None = None
    signals: bool = False  # the engine's answer gets the picker signals appended


def _tag(body: dict[str, Any], tenant: Any, tenant_id: str, salt: str | None) -> None:
    for name in OWNED_FIELDS:
        body.pop(name, None)
    body["priority"] = tenant.priority
    if salt is not None:
        body["cache_salt"] = salt


GET = frozenset({"GET"})
POST = frozenset({"POST"})
ROUTES: dict[str, Route] = {
    "/health": Route(GET, credentials=False),
    "/ping": Route(GET | POST, credentials=False),
    "/version": Route(GET, credentials=False),
    "/metrics": Route(GET, credentials=False, signals=True),
    "/tokenize": Route(POST, credentials=True),
    "/detokenize": Route(POST, credentials=True),
    "/v1/embeddings": Route(POST, credentials=True, tag=_tag),
}


def supported_routes() -> str:
    return ", ".join(sorted({*GENERATION_ROUTES, *ROUTES, *HEALTH_ROUTES}))


class Passthrough:
    """The routes above: tenants through `intake` (policy, credentials, body cap), the
    engine through `upstream`, the picker signals from `signals`."""

    def __init__(self, intake: Intake, upstream: Upstream, signals: Callable[[], bytes]
                 ) -> None:
        self.intake = intake
        self.upstream = upstream
        self.signals = signals

    def route(self, path: str) -> Route | None:
        return ROUTES.get(path)

    async def handle(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        intake = self.intake
        body = b""
        body_read = False
        try:
            if scope["method"] not in route.methods:
                raise ApiError(405, errors.METHOD_NOT_ALLOWED,
                               f"use {' or '.join(sorted(route.methods))} on this route")
            if route.credentials:
                active = intake.active()
                tenant_id = intake.authenticate(active, scope["headers"])
                raw = await intake.read_body(
                    scope, receive, intake.body_limit(active, tenant_id, chat=False))
                if raw is None:
                    return
                body_read = True
                body = raw if route.tag is None else _tagged(
                    raw, route, active.policy.tenants[tenant_id], tenant_id,
                    active.cache_salts.get(tenant_id))
        except ApiError as error:
            await send_error(send, error if body_read else unread(scope, error))
            return
        upstream = self.upstream
        if route.signals:
            await serve_metrics(scope, send, upstream, self.signals)
            return
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string") or b""
        target = path + ("?" + query.decode("latin-1") if query else "")
        headers = request_headers(scope["headers"])
        await exchange(receive, send, upstream,
                       lambda: upstream.open(method, target, headers, body))


def _tagged(raw: bytes, route: Route, tenant: Any, tenant_id: str, salt: str | None) -> bytes:
    try:
        body = json.loads(raw)
    except ValueError:
        raise invalid("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    assert route.tag is not None
    route.tag(body, tenant, tenant_id, salt)
    return json.dumps(body, separators=(",", ":")).encode()
