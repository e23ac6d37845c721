"""The sidecar's ASGI apps: routes, lifespan, and the admission path of a request.

Two apps, one per port: `app` for clients (/v1/*, /healthz, /readyz) and `admin_app`
for the operator, Prometheus and the kubelet (/kvquota/status, /metrics, /healthz,
/readyz with its reasons). Nothing on the client port shows another tenant's usage,
the policy's errors or a server path.

A generation request goes through intake (policy, caller, capped body), counting,
admission (decide and reserve, synchronously, so atomic) and the relay, which releases
the reservation whatever happened. `Gateway` builds those parts in dependency order and
tells each request's steps to the configured observer (`telemetry.observer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine_sidecar.contract.names import STATUS_ROUTE
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.admitter import Admitter
from engine_sidecar.gateway.admission.decode_pace import DecodePace
from engine_sidecar.gateway.admission.output_estimate import OutputEstimates
from engine_sidecar.gateway.admission.rules import PoolView
from engine_sidecar.gateway.config import GatewayConfig
from engine_sidecar.gateway.counting.tokenizer_setup import TokenizerSetup
from engine_sidecar.gateway.counting.tokens import HfTokenCounter, TokenCounter
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.body import closing, unread
from engine_sidecar.gateway.intake.entry import Intake
from engine_sidecar.gateway.intake.openai_request import Kind
from engine_sidecar.gateway.policy.active import PolicyHolder
from engine_sidecar.gateway.policy.source import PolicySource
from engine_sidecar.gateway.pool.link import PoolLink
from engine_sidecar.gateway.relay.admitted import Relay
from engine_sidecar.gateway.relay.exchange import Upstream, send_error
from engine_sidecar.gateway.relay.models_route import ModelsRoute
from engine_sidecar.gateway.relay.passthrough import Passthrough, supported_routes
from engine_sidecar.gateway.request_id import RequestIds
from engine_sidecar.gateway.telemetry.engine_stats import EngineStatsReader
from engine_sidecar.gateway.telemetry.metrics import GatewayMetrics, StateSources
from engine_sidecar.gateway.telemetry.picker_signals import PickerSignals, SignalSources
from engine_sidecar.gateway.telemetry.status import build_status, hide_paths
from engine_sidecar.gateway.upstream.engine_monitor import EngineMonitor

__all__ = ["Gateway", "GatewayConfig", "create_app"]

logger = logging.getLogger(__name__)

ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


class Gateway:
    """The sidecar's parts, wired once; `.app` serves clients, `.admin_app` the admin
    port."""

    def __init__(
        self,
        config: GatewayConfig,
        policy_source: PolicySource | None,
        *,
        token_counter: TokenCounter | None = None,
    ) -> None:
        self.config = config
        self.observer = config.observer
        self.metrics = GatewayMetrics(config.tenant_label_limit)
        self.holder = PolicyHolder(
            config.secrets_dir, config.plugin_policy_path,
            on_error=lambda _message: self.metrics.policy_errors.inc(),
            on_change=lambda active: self.metrics.retain_tenants(active.policy.tenants),
            engine=config.engine_id,
        )
        self.policy_source = policy_source
        self.stats = EngineStatsReader(config.stats_path)
        self.monitor = EngineMonitor(interval=config.engine_probe_interval)
        self.estimates = OutputEstimates()  # learned from the responses relayed
        self.pace = DecodePace()  # the engine's pace on the streams relayed
        self.upstream = Upstream(
            config.upstream, request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout, on_error=self._upstream_failed,
            data_plane=config.data_plane, engine_key=config.engine_key,
        )
        self.tokenizers = TokenizerSetup(config, self.upstream, self.monitor, self.holder,
                                         token_counter)
        self.intake = Intake(config, self.holder, self.metrics)
        self.pool_link = PoolLink(config.secrets_dir, config.engine_id,
                                  store_secrets_dir=config.pool_store_secrets_dir)
        self.admitter = Admitter(
            intake=self.intake, holder=self.holder, metrics=self.metrics,
            stats=self.stats.current, monitor=self.monitor, estimates=self.estimates,
            tokenizers=self.tokenizers, retry_after=config.retry_after_seconds,
            pool_link=self.pool_link, pace=self.pace,
        )
        self.ledger = self.admitter.ledger
        self.relay = Relay(config, self.upstream, self.holder, self.metrics, self.estimates,
                           self.pace)
        self.queue = self.admitter.queue
        self.prompts = self.admitter.prompts
        self.counters = self.admitter.counters
        self.metrics.attach_state(StateSources(
            ledger=self.ledger,
            active=lambda: self.holder.active,
            stats=self.stats.current,
            label=self.admitter.tenant_label,
            queue=self.queue,
        ))
        # Per-tier queue and KV series for endpoint pickers, on the client port's /metrics.
        self.signals = PickerSignals(SignalSources(
            active=lambda: self.holder.active, stats=self.stats.current,
            view=self.admitter.capacity, queue=self.queue,
        ))
        # vLLM's other routes (passthrough.py)
        self.passthrough = Passthrough(self.intake, self.upstream, self.signals.exposition)
        # The proxied routes bypass Starlette's routing and middleware: they run once per
        # request and their `send` once per token chunk. Everything else is Starlette.
        self._proxied: dict[str, tuple[str, ASGIHandler]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/responses": ("POST", self._responses),
            "/v1/models": ("GET", ModelsRoute(self.intake, self.upstream)),
        }
        self.starlette = Starlette(
            routes=[
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={HTTPException: _http_exception},
        )
        # No lifespan: the client app's runs the gateway's tasks, once.
        self.admin_starlette = Starlette(
            routes=[
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._admin_readyz, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route(STATUS_ROUTE, self._status, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_exception},
        )
        # Every answer on the client port carries the request's x-request-id.
        self.app: ASGIHandler = RequestIds(_GatewayApp(self.dispatch))
        self.admin_app: ASGIHandler = _GatewayApp(self.dispatch_admin)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (route := self._proxied.get(scope["path"])):
            method, handler = route
            if scope["method"] != method:
                await send_error(send, unread(scope, ApiError(
                    405, errors.METHOD_NOT_ALLOWED, f"use {method} on this route")))
                return
            try:
                await handler(scope, receive, send)
            except Exception:  # a bug: answer like an API, keep the trace in the log only
                logger.exception("unhandled error on %s", scope["path"])
                with contextlib.suppress(Exception):
                    await send_error(send, unread(scope, ApiError(
                        500, errors.INTERNAL_ERROR, "the sidecar failed on this request")))
            return
        if scope["type"] == "http" and (other := self.passthrough.route(scope["path"])):
            await self.passthrough.handle(scope, receive, send, other)
            return
        await self.starlette(scope, receive, closing(scope, send))

    async def dispatch_admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.admin_starlette(scope, receive, closing(scope, send))

    # -- state ---------------------------------------------------------------------

    @property
    def token_counter(self) -> TokenCounter | None:
        return self.tokenizers.counter

    @token_counter.setter
    def token_counter(self, counter: TokenCounter | None) -> None:
        self.tokenizers.counter = counter

    @property
    def tokenizer_error(self) -> str | None:
        return self.tokenizers.error

    def load_tokenizer(self, name: str) -> HfTokenCounter:
        """The local tokenizer `name`, its worker pool started (blocking; raises what the
        loader raises)."""
        return self.tokenizers.load(name)

    def capacity(self) -> PoolView | None:
        """The pool as admission sees it (None before a policy is loaded)."""
        return self.admitter.capacity()

    def readiness(self) -> list[str]:
        reasons = []
        if not self.monitor.up:
            reasons.append(self.monitor.error or "engine not answering")
        if self.holder.active is None:
            reasons.append(self.holder.error or "no policy loaded yet")
        if self.token_counter is None:
            reasons.append(self.tokenizer_error or "tokenizer still loading")
        return reasons

    # -- lifecycle -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.monitor.run(self.upstream.client), name="engine"),
                 asyncio.create_task(self.admitter.pump(), name="admission-queue"),
                 asyncio.create_task(self.pool_link.run(
                     lambda: self.queue.policy, self.admitter.capacity), name="pool-ledger")]
        if self.policy_source is not None:
            tasks.append(asyncio.create_task(self.policy_source.run(self.holder), name="policy"))
            logger.info("policy from %s", self.policy_source.description)
        if self.token_counter is None:
            tasks.append(asyncio.create_task(self.tokenizers.run(), name="tokenizer"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.upstream.aclose()
            self.tokenizers.close()
            self.pool_link.close()

    def _upstream_failed(self, kind: str) -> None:
        self.metrics.upstream_errors.labels(kind).inc()
        if kind == "connect":  # the engine, or the sidecar's own fd limit: the probe tells
            self.monitor.recheck()

    # -- generation routes -------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.COMPLETION)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.CHAT)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.RESPONSES)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        """Intake, admission, relay; the observer hears each step and the status sent."""
        arrived = time.perf_counter()
        trace = self.observer.request(scope)
        status: int | None = None
        try:
            body_read = False
            try:
                active = self.intake.active()
                tenant_id = self.intake.authenticate(active, scope["headers"], trace)
                raw = await self.intake.read_prompt_body(
                    scope, receive, active, tenant_id, chat=kind is not Kind.COMPLETION)
                if raw is None:
                    return
                body_read = True
                admitted = await self.admitter.admit(kind, raw, scope["headers"], receive,
                                                     active, tenant_id, trace)
            except ApiError as error:
                status = error.status
                logger.debug("refused %s: %d %s (tenant %s)", scope["path"], error.status,
                              error.code, tenant_id if body_read else "-")
                await send_error(send, error if body_read else unread(scope, error))
                return
            if admitted is None:
                return  # the client left while its request was queued
            status = await self.relay.run(scope, receive, send, admitted, kind, active,
                                          tenant_id, arrived, trace)
        finally:
            trace.ended(status)

    # -- health, metrics, status ---------------------------------------------------

    async def _healthz(self, _request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def _readyz(self, _request: Request) -> Response:
        """For clients and load balancers: ready or not, the reasons are on the admin
        port (they name the policy's problems)."""
        ready = not self.readiness()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def _admin_readyz(self, _request: Request) -> Response:
        reasons = [hide_paths(reason) for reason in self.readiness()]
        return JSONResponse({"ready": not reasons, "reasons": reasons},
                            status_code=503 if reasons else 200)

    async def _metrics(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _status(self, _request: Request) -> Response:
        status = build_status(
            ready=not self.readiness(), active=self.holder.active,
            policy_error=self.holder.error, ledger=self.ledger, counters=self.counters,
            stats=self.stats.current(), capacity=self.capacity(), queue=self.queue,
            stats_age=self.stats.age(), stats_stale=self.stats.stale(),
            pool_store_problem=self.pool_link.problem,
        )
        return Response(status.model_dump_json(by_alias=True), media_type="application/json")


class _GatewayApp:
    """An ASGI application: a plain object with an async `__call__`, so servers detect
    ASGI 3 (a bound method would look like ASGI 2 to uvicorn)."""

    def __init__(self, dispatch: ASGIHandler) -> None:
        self._dispatch = dispatch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._dispatch(scope, receive, send)


async def _http_exception(_request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    codes = {404: errors.NOT_FOUND, 405: errors.METHOD_NOT_ALLOWED}
    code = codes.get(status, errors.INVALID_REQUEST)
    message = {404: "no such route on the KVQuota sidecar; its client port serves "
                    + supported_routes(),
               405: "method not allowed on this route"}.get(status, "invalid request")
    error = ApiError(status, code, message)
    return Response(error.body(), status_code=status, media_type="application/json")


def create_app(
    config: GatewayConfig,
    policy_source: PolicySource | None,
    **kwargs: Any,
) -> ASGIHandler:
    return Gateway(config, policy_source, **kwargs).app
