"""The sidecar's ASGI apps: routes, lifespan, and the admission path of a request.

Two apps, one per port: `app` for clients (/v1/*, /healthz, /readyz) and `admin_app`
for the operator, Prometheus and the kubelet (/kvquota/status, /metrics, /healthz,
/readyz with its reasons). Nothing on the client port shows another tenant's usage,
the policy's errors or a server path.

Request path for POST /v1/completions, /v1/chat/completions and /v1/responses:
policy loaded? -> authenticate (headers only) -> read the body (capped for the tenant,
with a deadline) -> parse, and refuse a prompt too long by its size alone -> count
prompt tokens (cached; long ones in worker processes) -> decide + reserve (synchronously, so
atomic) -> rewrite -> stream to the engine -> release the reservation whatever
happened. A refusal sent before the body was read closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine_sidecar.contract.names import STATUS_ROUTE
from engine_sidecar.gateway import errors, tracing
from engine_sidecar.gateway.active_policy import ActivePolicy, PolicyHolder
from engine_sidecar.gateway.admission import (
    Decision,
    PoolView,
    RequestShape,
    sequence_blocks,
)
from engine_sidecar.gateway.admission_queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.affinity import affinity_headers, engine_namespace
from engine_sidecar.gateway.engine_auth import EngineKey
from engine_sidecar.gateway.engine_monitor import EngineMonitor
from engine_sidecar.gateway.engine_stats import EngineStatsReader
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.forward import (
    REQUEST_DROP,
    Upstream,
    exchange,
    request_headers,
    send_error,
    server_timing,
    wait_for_disconnect,
)
from engine_sidecar.gateway.frozen_heap import freeze_startup_objects
from engine_sidecar.gateway.ledger import Ledger, Reservation
from engine_sidecar.gateway.metrics import GatewayMetrics, StateSources
from engine_sidecar.gateway.model_names import engine_name, public_cards
from engine_sidecar.gateway.openai_request import Kind, rewrite, session_id
from engine_sidecar.gateway.output_estimate import OutputEstimates
from engine_sidecar.gateway.output_meter import OutputMeter
from engine_sidecar.gateway.passthrough import Passthrough, supported_routes
from engine_sidecar.gateway.picker_signals import PickerSignals, SignalSources
from engine_sidecar.gateway.policy_source import PolicySource
from engine_sidecar.gateway.prefix import prompt_fingerprints
from engine_sidecar.gateway.prompt_bounds import PromptLimit
from engine_sidecar.gateway.prompt_count import PromptCounting
from engine_sidecar.gateway.request_body import (
    BODY_BYTES_PER_TOKEN,
    CLOSE,
    body_limit,
    declared_length,
    declares_body,
    read_body,
)
from engine_sidecar.gateway.responses_request import rewrite_responses
from engine_sidecar.gateway.status import DecisionCounters, build_status, hide_paths
from engine_sidecar.gateway.tokens import EngineTokenCounter, HfTokenCounter, TokenCounter

logger = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]
QUEUE_HEADER = b"x-kvquota-queue-ms"  # on admitted responses: time spent in the queue
PUMP_INTERVAL_S = 0.05  # while requests queue: re-check capacity (new stats) and deadlines
MAX_MODEL_LIST_BYTES = 1024 * 1024  # the engine's /v1/models answer, read whole
ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class GatewayConfig:
    upstream: str = "http://127.0.0.1:8001"
    secrets_dir: Path | None = None
    plugin_policy_path: Path | None = None  # KVQUOTA_POLICY_PATH: the plugin reads it
    stats_path: Path | None = None  # KVQUOTA_STATS_PATH: the plugin writes it
    tokenizer: str | None = None  # None: the engine's model, then the policy's model
    engine_tokenizer: bool = False  # count with the engine's /tokenize only
    tokenizer_workers: int = 1  # processes tokenizing long prompts (`token_pool`)
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    retry_after_seconds: int = 1
    max_body_bytes: int = 32 * 1024 * 1024  # global cap; a tenant's is derived below it
    body_bytes_per_token: int = BODY_BYTES_PER_TOKEN  # raise it for image/audio inputs
    body_timeout: float = 30.0  # seconds to receive a whole request body, then 408
    tenant_label_limit: int = 100
    engine_probe_interval: float = 2.0
    extra_request_drop: set[bytes] = field(default_factory=set)
    engine_id: str | None = None  # POD_NAME: the engine a leased session returns to
    # POD_NAMESPACE: with engine_id, the pod a picker's session token names (`affinity`)
    engine_namespace: str | None = field(default_factory=engine_namespace)
    data_plane: str = "auto"  # "httptools" (fast), "httpx" (fallback), "auto"
    engine_key: EngineKey | None = None  # vLLM's --api-key, sent upstream (`engine_auth`)


class Gateway:
    """Sidecar state and handlers; `.app` serves clients, `.admin_app` the admin port."""

    def __init__(
        self,
        config: GatewayConfig,
        policy_source: PolicySource | None,
        *,
        token_counter: TokenCounter | None = None,
    ) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.tenant_label_limit)
        self.holder = PolicyHolder(
            config.secrets_dir, config.plugin_policy_path,
            on_error=lambda _message: self.metrics.policy_errors.inc(),
            on_change=lambda active: self.metrics.retain_tenants(active.policy.tenants),
            engine=config.engine_id,
        )
        self.policy_source = policy_source
        self.ledger = Ledger(on_release=lambda _reservation: self._queue_changed.set())
        self.counters = DecisionCounters()
        self.stats = EngineStatsReader(config.stats_path)
        self.monitor = EngineMonitor(interval=config.engine_probe_interval)
        self.estimates = OutputEstimates()  # learned from the responses relayed
        self.queue = AdmissionQueue(
            self.ledger, clock=time.monotonic, stats=self.stats.current,
            max_model_len=lambda: self.monitor.max_model_len, estimates=self.estimates,
        )
        self._queue_changed = asyncio.Event()
        self.upstream = Upstream(
            config.upstream, request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout, on_error=self._upstream_failed,
            data_plane=config.data_plane, engine_key=config.engine_key,
        )
        self.token_counter = token_counter
        self.prompts = PromptCounting()  # size floor, worker pool, token cache
        self.tokenizer_error: str | None = None
        self.metrics.attach_state(StateSources(
            ledger=self.ledger,
            active=lambda: self.holder.active,
            stats=self.stats.current,
            label=self._tenant_label,
            queue=self.queue,
        ))
        # Per-tier queue and KV series for endpoint pickers, on the client port's /metrics.
        self.signals = PickerSignals(SignalSources(
            active=lambda: self.holder.active, stats=self.stats.current,
            view=self.capacity, queue=self.queue,
        ))
        # The proxied routes bypass Starlette's routing and middleware: they run once per
        # request and their `send` once per token chunk. Everything else is Starlette.
        self._proxied: dict[str, tuple[str, ASGIHandler]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/responses": ("POST", self._responses),
            "/v1/models": ("GET", self._models),
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
        self._tier_children: dict[str, tuple[Any, Any, Any]] = {}
        # On a leased session's admitted responses: the engine that will hold its KV.
        self._affinity = affinity_headers(config.engine_id, config.engine_namespace)
        self.passthrough = Passthrough(self)  # vLLM's other routes (passthrough.py)
        self.app: ASGIHandler = _GatewayApp(self.dispatch)
        self.admin_app: ASGIHandler = _GatewayApp(self.dispatch_admin)
        tracing.instrument_from_env(self)  # spans only with OTEL_EXPORTER_OTLP_ENDPOINT set

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (route := self._proxied.get(scope["path"])):
            method, handler = route
            if scope["method"] != method:
                await send_error(send, _unread(scope, ApiError(
                    405, errors.METHOD_NOT_ALLOWED, f"use {method} on this route")))
                return
            try:
                await handler(scope, receive, send)
            except Exception:  # a bug: answer like an API, keep the trace in the log only
                logger.exception("unhandled error on %s", scope["path"])
                with contextlib.suppress(Exception):
                    await send_error(send, _unread(scope, ApiError(
                        500, errors.INTERNAL_ERROR, "the sidecar failed on this request")))
            return
        if scope["type"] == "http" and (other := self.passthrough.route(scope["path"])):
            await self.passthrough.handle(scope, receive, send, other)
            return
        await self.starlette(scope, receive, _closing(scope, send))

    async def dispatch_admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.admin_starlette(scope, receive, _closing(scope, send))

    def _tier_metrics(self, tier: str) -> tuple[Any, Any, Any]:
        """(ttft, duration, reserved-blocks) children for a tier, looked up once."""
        children = self._tier_children.get(tier)
        if children is None:
            children = (self.metrics.ttft.labels(tier), self.metrics.duration.labels(tier),
                        self.metrics.reserved_blocks.labels(tier))
            self._tier_children[tier] = children
        return children

    # -- lifecycle -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.monitor.run(self.upstream.client), name="engine"),
                 asyncio.create_task(self._pump_queue(), name="admission-queue")]
        if self.policy_source is not None:
            tasks.append(asyncio.create_task(self.policy_source.run(self.holder), name="policy"))
            logger.info("policy from %s", self.policy_source.description)
        if self.token_counter is None:
            tasks.append(asyncio.create_task(self._load_tokenizer(), name="tokenizer"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.upstream.aclose()

    def load_tokenizer(self, name: str) -> HfTokenCounter:
        """The local tokenizer `name`, its worker pool started (blocking; raises what the
        loader raises)."""
        counter = HfTokenCounter.load(name, EngineTokenCounter(self.upstream, None),
                                      workers=self.config.tokenizer_workers,
                                      retry_after=self.config.retry_after_seconds)
        if counter.pool is not None:
            counter.pool.start()
        freeze_startup_objects()
        return counter

    async def _load_tokenizer(self) -> None:
        """The engine's /tokenize when asked for; else the tokenizer named, or found (the
        engine's model, the policy's). None loadable is an error the readiness shows,
        never a silent fall-back to a round trip per request (issue #18)."""
        if self.config.engine_tokenizer:
            self.token_counter = EngineTokenCounter(self.upstream, None)
            return
        tried: dict[str, str] = {}
        while True:
            candidates = [self.config.tokenizer] if self.config.tokenizer else [
                self.monitor.model_root, self.monitor.model,
                self.holder.active.policy.model if self.holder.active else None,
            ]
            for name in candidates:
                if not name or name in tried:
                    continue
                try:
                    self.token_counter = await asyncio.to_thread(self.load_tokenizer, name)
                    logger.info("counting prompt tokens with %s", self.token_counter.description)
                    return
                except Exception as exc:  # any loader failure: try the next candidate
                    tried[name] = type(exc).__name__
                    logger.warning("tokenizer %r not loadable here (%s)", name, tried[name])
            if self.config.tokenizer or (self.monitor.model and self.holder.active):
                break
            await asyncio.sleep(1.0)
        self.tokenizer_error = (
            "no tokenizer could be loaded (tried " + ", ".join(
                f"{hide_paths(name)}: {error}" for name, error in tried.items())
            + "); pass --tokenizer with the model's tokenizer, or --engine-tokenizer to count "
            "every prompt with the engine's /tokenize (one round trip per request)")
        logger.error("%s", self.tokenizer_error)

    def _upstream_failed(self, kind: str) -> None:
        self.metrics.upstream_errors.labels(kind).inc()
        if kind == "connect":  # the engine, or the sidecar's own fd limit: the probe tells
            self.monitor.recheck()

    # -- helpers -------------------------------------------------------------------

    def _tenant_label(self, tenant_id: str) -> str:
        active = self.holder.active
        return self.metrics.labels(tenant_id, active.policy.tenants if active else {})

    def capacity(self) -> PoolView | None:
        """The pool as admission sees it (None before a policy is loaded)."""
        active = self.holder.active
        if active is None:
            return None
        self._sync_policy(active)
        return self.queue.view()

    def _sync_policy(self, active: ActivePolicy) -> None:
        if self.queue.policy is not active.policy:
            self.queue.set_policy(active.policy)

    async def _pump_queue(self) -> None:
        """Admit queued requests as capacity frees: at once on every release, and every
        PUMP_INTERVAL_S while any wait (the plugin's stats move, deadlines pass)."""
        while True:
            if self.queue.waiting():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), PUMP_INTERVAL_S)
            else:
                await self._queue_changed.wait()
            self._queue_changed.clear()
            active = self.holder.active
            if active is not None:
                self._sync_policy(active)
                self.queue.pump()

    def readiness(self) -> list[str]:
        reasons = []
        if not self.monitor.up:
            reasons.append(self.monitor.error or "engine not answering")
        if self.holder.active is None:
            reasons.append(self.holder.error or "no policy loaded yet")
        if self.token_counter is None:
            reasons.append(self.tokenizer_error or "tokenizer still loading")
        return reasons

    async def _read_body(
        self, scope: Scope, receive: Receive, active: ActivePolicy, tenant_id: str, kind: Kind
    ) -> bytes | None:
        limit = body_limit(
            active.policy.tenants[tenant_id], block_size=active.policy.block_size,
            chat=kind is not Kind.COMPLETION, cap=self.config.max_body_bytes,
            bytes_per_token=self.config.body_bytes_per_token,
        )
        try:
            return await read_body(receive, limit, self.config.body_timeout,
                                   declared_length(scope))
        except ApiError as error:
            raise self._reject(error, "too_large" if error.status == 413 else "slow_body"
                               ) from None

    def _reject(self, error: ApiError, reason: str) -> ApiError:
        self.metrics.rejections.labels(reason).inc()
        return error

    def _authenticate(self, active: ActivePolicy, headers: list[tuple[bytes, bytes]]) -> str:
        try:
            return active.auth.authenticate(headers)
        except ApiError as error:
            self.metrics.admissions.labels("unknown", "", Decision.REJECTED_AUTH).inc()
            reason = {400: "invalid_request", 403: "unknown_tenant"}.get(
                error.status, "unauthenticated")
            raise self._reject(error, reason) from None

    def _active(self) -> ActivePolicy:
        active = self.holder.active
        if active is None:
            raise self._reject(ApiError(
                503, errors.POLICY_NOT_LOADED,
                "the sidecar has no valid policy yet; check the pool's status",
                retry_after=self.config.retry_after_seconds,
            ), "not_ready")
        return active

    # -- generation routes -------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.COMPLETION)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.CHAT)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, Kind.RESPONSES)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        arrived = time.perf_counter()
        body_read = False
        try:
            active = self._active()
            tenant_id = self._authenticate(active, scope["headers"])
            raw = await self._read_body(scope, receive, active, tenant_id, kind)
            if raw is None:
                return
            body_read = True
            admitted = await self._admit(kind, raw, scope["headers"], receive, active,
                                         tenant_id)
        except ApiError as error:
            await send_error(send, error if body_read else _unread(scope, error))
            return
        if admitted is None:
            return  # the client left while its request was queued
        reservation, body, tier, waited, n = admitted
        extra_headers = [(QUEUE_HEADER, str(round(waited * 1000)).encode()),
                         server_timing("admit", arrived)]
        leasing = active.policy.tenants.get(tenant_id)
        if reservation.session and leasing is not None and leasing.lease.seconds > 0:
            extra_headers.extend(self._affinity)
        outcome = "cancelled"
        meter = OutputMeter(kind.value)
        try:
            forward_headers = self._forward_headers(scope)
            path = scope["path"]
            result = await exchange(
                receive, send, self.upstream,
                lambda: self.upstream.open("POST", path, forward_headers, body),
                on_done=reservation.release,
                extra_headers=extra_headers,
                on_chunk=meter.feed,
            )
            outcome = result.outcome
            produced = meter.output_tokens(n)
            if outcome == "completed" and produced is not None:
                self.estimates.observe(tenant_id, kind.value, produced, n)
            ttft, duration, _ = self._tier_metrics(tier)
            if result.ttft is not None:
                ttft.observe(result.ttft)
            duration.observe(result.duration)
        finally:
            reservation.release(outcome)
            self.metrics.reservations.labels(tier, outcome).inc()

    async def _admit(
        self, kind: Kind, raw: bytes, raw_headers: list[tuple[bytes, bytes]], receive: Receive,
        active: ActivePolicy, tenant_id: str,
    ) -> tuple[Reservation, bytes, str, float, int] | None:
        """Count an authenticated request, then wait in the tenant's queue until admitted
        (or refused); None if the client went away meanwhile."""
        counter = self.token_counter
        if counter is None:
            raise self._reject(ApiError(
                503, errors.SIDECAR_NOT_READY, "the sidecar is still loading the tokenizer",
                retry_after=self.config.retry_after_seconds), "not_ready")
        tenant = active.policy.tenants[tenant_id]
        try:  # cheap checks first, then the cache, then tokenizing (`prompt_count`)
            request = await self.prompts.parse(kind, raw, counter, PromptLimit(
                tenant_id, tenant.max_prompt_tokens, self.monitor.max_model_len))
            if "model" in request.body:  # the public name /v1/models shows -> the engine's
                request.body["model"] = engine_name(request.body["model"], self.monitor.model,
                                                    active.policy.model)
            prompts = await self.prompts.count(counter, request, self.monitor.model)
        except ApiError as error:
            if error.code == errors.PROMPT_TOO_LONG:
                self._count_decision(tenant_id, tenant.tier.value, Decision.REJECTED_PROMPT)
            raise self._reject(error, "tokenizer_busy" if error.code == errors.TOKENIZER_BUSY
                               else "invalid_request") from None
        active = self.holder.active or active  # a policy swap during counting wins
        if tenant_id not in active.policy.tenants:
            raise self._reject(ApiError(
                403, errors.UNKNOWN_TENANT,
                f"tenant {tenant_id!r} is no longer in the pool's policy"), "unknown_tenant")
        self._sync_policy(active)
        session = session_id(dict(raw_headers), request.body)
        shape = RequestShape(
            tuple(len(p) for p in prompts), request.requested_max_tokens, request.n,
            request.prompt_param, request.max_tokens_param, session,
            prompt_fingerprints(prompts, active.policy.block_size), kind.value,
        )
        ticket = self.queue.submit(tenant_id, shape)
        if not ticket.settled and not await self._wait_in_queue(ticket, receive):
            return None
        tenant = active.policy.tenants[tenant_id]
        tier = tenant.tier.value
        verdict = ticket.verdict
        assert verdict is not None
        decision = Decision.ADMITTED if ticket.admitted else verdict.decision
        self._count_decision(tenant_id, tier, decision)
        self.metrics.queue_wait.labels(tier, "admitted" if ticket.admitted else "refused"
                                       ).observe(ticket.waited)
        if ticket.error is not None:
            raise self._reject(ticket.error, decision.removeprefix("rejected_"))
        reservation = ticket.reservation
        assert reservation is not None
        try:
            body = (rewrite_responses if kind is Kind.RESPONSES else rewrite)(
                request, max_tokens=verdict.max_tokens, priority=tenant.priority,
                tenant_id=tenant_id, session=session,
                cache_salt=active.cache_salts.get(tenant_id),
                reserved_blocks=sequence_blocks(shape, verdict.output_tokens,
                                                active.policy.block_size),
            )
        except BaseException:
            reservation.release("error")
            raise
        self._tier_metrics(tier)[2].inc(verdict.blocks)
        # Sequences the response's output tokens are spread over (a batch of prompts,
        # n choices each): the estimate is per sequence.
        return reservation, body, tier, ticket.waited, request.n * max(1, len(prompts))

    def _count_decision(self, tenant_id: str, tier: str, decision: Decision) -> None:
        self.metrics.admissions.labels(self._tenant_label(tenant_id), tier, decision).inc()
        self.counters.count(tenant_id, decision)

    async def _wait_in_queue(self, ticket: Ticket, receive: Receive) -> bool:
        """Wait until the queue settles the ticket; False if the client left first (the
        ticket leaves the queue, or gives back what it was just granted)."""
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_ticket: Ticket) -> None:
            if not settled.done():
                settled.set_result(None)

        ticket.on_settled = wake
        self._queue_changed.set()  # the pump loop now polls while requests wait
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        left = True
        try:
            await asyncio.wait((settled, gone), return_when=asyncio.FIRST_COMPLETED)
            left = gone.done()
        finally:  # also when this handler is cancelled (server shutdown)
            gone.cancel()
            ticket.on_settled = None
            if left:
                if ticket.reservation is not None:
                    ticket.reservation.release("cancelled")
                else:
                    self.queue.cancel(ticket)
        return not left

    def _forward_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        drop = set(REQUEST_DROP) | self.config.extra_request_drop | {b"content-type"}
        active = self.holder.active
        if active is not None and active.auth.trusted_header is not None:
            drop.add(active.auth.trusted_header)
        return [*request_headers(scope["headers"], drop), *JSON_HEADERS]

    # -- other routes -----------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The engine's model list with server paths replaced by the served name."""
        try:
            active = self._active()
            self._authenticate(active, scope["headers"])
            status, payload = await self._engine_models(scope)
        except ApiError as error:
            await send_error(send, _unread(scope, error))
            return
        body = json.dumps(public_cards(payload, active.policy.model),
                          separators=(",", ":")).encode()
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        if declares_body(scope):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _engine_models(self, scope: Scope) -> tuple[int, Any]:
        forward_headers = request_headers(scope["headers"])
        response = await self.upstream.open("GET", "/v1/models", forward_headers, b"")
        try:
            if response.status_code >= 500:
                raise self.upstream.failure_status(response.status_code)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > MAX_MODEL_LIST_BYTES:
                    raise ValueError("model list too large")
                chunks.append(chunk)
            return response.status_code, json.loads(b"".join(chunks))
        except OSError as exc:
            raise self.upstream.failure(exc) from None
        except ValueError:
            raise ApiError(502, errors.UPSTREAM_ERROR,
                           "the inference engine's /v1/models answer is not a JSON model "
                           "list") from None
        finally:
            await response.aclose()

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
        )
        return Response(status.model_dump_json(by_alias=True), media_type="application/json")


class _GatewayApp:
    """An ASGI application: a plain object with an async `__call__`, so servers detect
    ASGI 3 (a bound method would look like ASGI 2 to uvicorn)."""

    def __init__(self, dispatch: ASGIHandler) -> None:
        self._dispatch = dispatch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._dispatch(scope, receive, send)


def _unread(scope: Scope, error: ApiError) -> ApiError:
    """`error` as the answer to a request whose body was not read: the connection
    closes, so the client cannot keep it open by sending the rest slowly."""
    if not declares_body(scope) or error.headers.get("connection") == "close":
        return error
    return dataclasses.replace(error, headers={**error.headers, **CLOSE})


def _closing(scope: Scope, send: Send) -> Send:
    """`send` for routes that never read a body: one the client declared closes the
    connection after the response."""
    if scope["type"] != "http" or not declares_body(scope):
        return send

    async def send_closing(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"connection", b"close")]}
        await send(message)

    return send_closing


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
