"""Admission of an authenticated generation request: count, queue, decide, rewrite.

The request's prompt is counted (`counting.prompt_count`), its shape goes to its
tenant's queue (`queue`), and it waits there until the queue admits it (a reservation
in the ledger) or refuses it, or the client leaves. An admitted body is rewritten for
the engine with what the decision granted; `pump` re-runs the queue as capacity frees.

Counting only when it decides: where the tokenizer bounds a prompt by its size, a
request whose tenant has nothing queued is first decided at that ceiling and goes on at
once (`ceiling`): its exact count, taken off its path, then shrinks its reservation.
Otherwise (it would wait or be refused at the ceiling, or its default max_tokens would
depend on the count) it is counted first and decided as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Receive

from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.call_back import calls_back
from engine_sidecar.gateway.admission.ceiling import CeilingAdmission
from engine_sidecar.gateway.admission.decode_pace import DecodePace
from engine_sidecar.gateway.admission.ledger import Ledger, Reservation
from engine_sidecar.gateway.admission.output_estimate import OutputEstimates
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import Decision, PoolView, RequestShape, sequence_blocks
from engine_sidecar.gateway.counting.prefix import prompt_fingerprints
from engine_sidecar.gateway.counting.prompt_bounds import PromptLimit
from engine_sidecar.gateway.counting.prompt_count import PromptCounting
from engine_sidecar.gateway.counting.tokenizer_setup import TokenizerSetup
from engine_sidecar.gateway.counting.tokens import TokenCounter, TokenIds
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.body_checks import shown
from engine_sidecar.gateway.intake.entry import Intake
from engine_sidecar.gateway.intake.model_names import engine_name, is_served, served_names
from engine_sidecar.gateway.intake.openai_request import Kind, ParsedRequest, rewrite, session_id
from engine_sidecar.gateway.intake.responses_request import rewrite_responses
from engine_sidecar.gateway.policy.active import ActivePolicy, PolicyHolder
from engine_sidecar.gateway.pool.link import PoolLink
from engine_sidecar.gateway.relay.exchange import wait_for_disconnect
from engine_sidecar.gateway.telemetry.metrics import GatewayMetrics
from engine_sidecar.gateway.telemetry.observer import NO_TRACE, RequestTrace
from engine_sidecar.gateway.telemetry.status import DecisionCounters
from engine_sidecar.gateway.upstream.engine_monitor import EngineMonitor

logger = logging.getLogger(__name__)

PUMP_INTERVAL_S = 0.05  # while requests queue: re-check capacity (new stats) and deadlines


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted request: its reservation and the body to send the engine."""

    reservation: Reservation
    body: bytes
    tier: str
    waited: float  # seconds in the queue
    # Sequences the response's output tokens are spread over (a batch of prompts, n
    # choices each): the output estimate is per sequence.
    sequences: int
    # A leased session's: is it told to bring its next turn back here (None: no lease).
    call_back: bool | None = None


class Admitter:
    def __init__(
        self, *, intake: Intake, holder: PolicyHolder, metrics: GatewayMetrics,
        stats: Callable[[], EngineStats | None], monitor: EngineMonitor,
        estimates: OutputEstimates, tokenizers: TokenizerSetup, retry_after: int,
        pool_link: PoolLink | None = None, pace: DecodePace | None = None,
    ) -> None:
        self.intake = intake
        self.holder = holder
        self.metrics = metrics
        self.monitor = monitor
        self.tokenizers = tokenizers
        self.retry_after = retry_after
        self.counters = DecisionCounters()
        self.prompts = PromptCounting()  # size floor, worker pool, token cache
        self._changed = asyncio.Event()
        # A released reservation may admit a queued request: it wakes the pump (and
        # tells the pool-wide ledger, when the pool has one).
        self.ledger = Ledger(on_release=self._released)
        self.queue = AdmissionQueue(
            self.ledger, clock=time.monotonic, stats=stats,
            max_model_len=lambda: monitor.max_model_len, estimates=estimates, pace=pace,
        )
        self.pool_link = pool_link  # the pool-wide ledger, when the policy names a store
        if pool_link is not None:
            pool_link.wake = self.wake  # the store's answers, off the loop, re-run the queue
        holder.subscribe(self.sync_policy)  # reads (`capacity`) see the policy in force
        self.ceiling = CeilingAdmission(self.queue, self.prompts, monitor, self.wake)

    def _released(self, reservation: Reservation) -> None:
        self.queue.released(reservation.tenant_id)
        self.wake()

    def wake(self) -> None:
        """Capacity may have freed (a reservation was released): re-run the queue."""
        self._changed.set()

    async def admit(
        self, kind: Kind, raw: bytes, raw_headers: list[tuple[bytes, bytes]],
        receive: Receive, active: ActivePolicy, tenant_id: str,
        trace: RequestTrace = NO_TRACE,
    ) -> Admitted | None:
        """Count an authenticated request, then wait in the tenant's queue until admitted
        (or refused: raises the refusal); None if the client went away meanwhile."""
        trace.admission_started()
        try:
            admitted = await self._admit(kind, raw, raw_headers, receive, active, tenant_id,
                                         trace)
        except ApiError as error:
            trace.admission_ended(error, left=False)
            raise
        trace.admission_ended(None, left=admitted is None)
        return admitted

    async def _admit(
        self, kind: Kind, raw: bytes, raw_headers: list[tuple[bytes, bytes]],
        receive: Receive, active: ActivePolicy, tenant_id: str, trace: RequestTrace,
    ) -> Admitted | None:
        reject = self.intake.reject
        counter = self.tokenizers.counter
        if counter is None:
            raise reject(ApiError(
                503, errors.SIDECAR_NOT_READY, "the sidecar is still loading the tokenizer",
                retry_after=self.retry_after), "not_ready")
        tenant = active.policy.tenants[tenant_id]
        try:  # cheap checks first, then the cache, then tokenizing (`prompt_count`)
            request = await self.prompts.parse(kind, raw, counter, PromptLimit(
                tenant_id, tenant.max_prompt_tokens, self.monitor.max_model_len))
        except ApiError as error:
            raise self._count_error(error, tenant_id, tenant.tier.value) from None
        if "model" in request.body:  # the public name /v1/models shows -> the engine's
            await self._check_model(request.body["model"], active)
            request.body["model"] = engine_name(request.body["model"], self.monitor.model,
                                                active.policy.model)
        session = session_id(dict(raw_headers), request.body)
        ticket = self._admit_at_ceiling(counter, request, tenant_id, session, kind)
        if ticket is None:
            prompts = await self._count(counter, request, tenant_id, tenant.tier.value)
            active = self._still_known(active, tenant_id)  # a swap during counting wins
            shape = RequestShape(
                tuple(len(p) for p in prompts), request.requested_max_tokens, request.n,
                request.prompt_param, request.max_tokens_param, session,
                prompt_fingerprints(prompts, active.policy.block_size), kind.value,
            )
            ticket = self.queue.submit(tenant_id, shape)
        else:  # decided now on the policy in force (`_admit_at_ceiling`)
            active = self.holder.active or active
            shape = ticket.shape
            self.metrics.tier(active.policy.tenants[tenant_id].tier.value
                              ).ceiling_admissions.inc()
        trace.queued(ticket)
        if not ticket.settled and not await self._wait_in_queue(ticket, receive, trace):
            return None
        tenant = active.policy.tenants[tenant_id]
        tier = tenant.tier.value
        verdict = ticket.verdict
        assert verdict is not None
        decision = Decision.ADMITTED if ticket.admitted else verdict.decision
        self.count_decision(tenant_id, tier, decision)
        self.metrics.queue_wait.labels(tier, "admitted" if ticket.admitted else "refused"
                                       ).observe(ticket.waited)
        if ticket.error is not None:
            raise reject(ticket.error, decision.removeprefix("rejected_"))
        reservation = ticket.reservation
        assert reservation is not None
        try:
            body = (rewrite_responses if kind is Kind.RESPONSES else rewrite)(
                request, max_tokens=verdict.max_tokens, priority=tenant.priority,
                tenant_id=tenant_id, session=session,
                cache_salt=active.cache_salts.get(tenant_id),
                # At the ceiling's prompt when decided on it; the plugin takes it at
                # the prompt's exact length, its own count (`reserved_output`).
                reserved_blocks=sequence_blocks(shape, verdict.output_tokens,
                                                active.policy.block_size),
                reserved_output=max(0, verdict.output_tokens),
                above_max=verdict.above_max,
            )
        except BaseException:
            reservation.release("error")
            raise
        self.metrics.tier(tier).reserved_blocks.inc(verdict.blocks)
        call_back = None
        if reservation.session and tenant.lease.seconds > 0:
            call_back = calls_back(self.queue.view(), tenant_id, reservation.session,
                                   reservation.turn_blocks, tenant.max_blocks_per_engine)
        return Admitted(reservation, body, tier, ticket.waited,
                        request.n * max(1, len(shape.prompt_tokens)), call_back)

    async def _check_model(self, requested: object, active: ActivePolicy) -> None:
        """A model the engine does not serve is OpenAI's 404 `model_not_found`, naming
        what is served, before the request is counted or queued. The engine's list is
        read again first: an adapter may have been loaded since it was last read."""
        monitor, served_name = self.monitor, active.policy.model
        if not monitor.served or is_served(requested, monitor.served, served_name):
            return
        await monitor.learn_models()
        if is_served(requested, monitor.served, served_name):
            return
        names = ", ".join(served_names(monitor.served, served_name))
        raise self.intake.reject(ApiError(
            404, errors.MODEL_NOT_FOUND,
            f"The model {shown(requested)} does not exist here; this server serves: {names}",
            param="model", error_type="invalid_request_error"), "model_not_found")

    def _count_error(self, error: ApiError, tenant_id: str, tier: str) -> ApiError:
        if error.code == errors.PROMPT_TOO_LONG:
            self.count_decision(tenant_id, tier, Decision.REJECTED_PROMPT)
        return self.intake.reject(error, "tokenizer_busy" if error.code == errors.TOKENIZER_BUSY
                                  else "invalid_request")

    async def _count(self, counter: TokenCounter, request: ParsedRequest, tenant_id: str,
                     tier: str) -> tuple[TokenIds, ...]:
        try:
            return await self.prompts.count(counter, request, self.monitor.model)
        except ApiError as error:
            raise self._count_error(error, tenant_id, tier) from None

    def _still_known(self, active: ActivePolicy, tenant_id: str) -> ActivePolicy:
        """The policy in force now; 403 if it no longer has the tenant."""
        active = self.holder.active or active
        if tenant_id not in active.policy.tenants:
            raise self.intake.reject(ApiError(
                403, errors.UNKNOWN_TENANT,
                f"tenant {tenant_id!r} is no longer in the pool's policy"), "unknown_tenant")
        return active

    def _admit_at_ceiling(self, counter: TokenCounter, request: ParsedRequest,
                          tenant_id: str, session: str | None, kind: Kind) -> Ticket | None:
        """Admitted at its prompts' ceiling (`ceiling`), on the policy in force."""
        active = self.holder.active
        if active is None or tenant_id not in active.policy.tenants:
            return None
        return self.ceiling.admit(active, counter, request, tenant_id, session, kind)

    def count_decision(self, tenant_id: str, tier: str, decision: Decision) -> None:
        self.metrics.admissions.labels(self.tenant_label(tenant_id), tier, decision).inc()
        self.counters.count(tenant_id, decision)

    def tenant_label(self, tenant_id: str) -> str:
        active = self.holder.active
        return self.metrics.labels(tenant_id, active.policy.tenants if active else {})

    async def _wait_in_queue(self, ticket: Ticket, receive: Receive,
                             trace: RequestTrace) -> bool:
        """Wait until the queue settles the ticket; False if the client left first (the
        ticket leaves the queue, or gives back what it was just granted)."""
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_ticket: Ticket) -> None:
            if not settled.done():
                settled.set_result(None)

        trace.queue_wait_started()
        ticket.on_settled = wake
        self._changed.set()  # the pump loop now polls while requests wait
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
        trace.queue_wait_ended(not left)
        return not left

    def capacity(self) -> PoolView | None:
        """The pool as admission sees it (None before a policy is loaded). A read: the
        queue follows the policy as it changes (`sync_policy`, subscribed)."""
        return None if self.queue.policy is None else self.queue.view()

    def sync_policy(self, active: ActivePolicy) -> None:
        """Follow the policy the holder just made active (its listener)."""
        if self.queue.policy is active.policy:
            return
        self.queue.set_policy(active.policy)
        if self.pool_link is not None:
            self.queue.pool = self.pool_link.for_policy(active.policy)
            if self.queue.pool is not None:
                # A new split: give back a share that fell, claim one that rose.
                self.queue.pool.refresh(active.policy, self.queue.view())

    async def pump(self) -> None:
        """Admit queued requests as capacity frees: at once on every release, and every
        PUMP_INTERVAL_S while any wait (the plugin's stats move, deadlines pass)."""
        while True:
            if self.queue.waiting():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), PUMP_INTERVAL_S)
            else:
                await self._changed.wait()
            self._changed.clear()
            if self.queue.policy is not None:
                self.queue.pump()
