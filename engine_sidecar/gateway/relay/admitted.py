"""An admitted request to the engine and its answer back to the client.

The rewritten body goes to the engine with the client's allowed headers
(`exchange.request_headers`, minus the policy's trusted tenant header); the answer
streams back untouched (`exchange.exchange`) with the time queued, and for a leased
session the engine that will hold its KV (`affinity`), its session token only while
a next turn of the session fits under its tenant's ceiling here. The reservation is
released as soon as the engine is done, whatever happened; the output tokens counted
on the way (`output_meter`) move the request's charge as it decodes and, at the end,
teach the tenant's output estimate; a completed stream teaches the engine's pace
(`decode_pace`, Retry-After's estimate for holders that report no progress).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from engine_sidecar.gateway.admission.admitter import Admitted
from engine_sidecar.gateway.admission.decode_pace import DecodePace
from engine_sidecar.gateway.admission.output_estimate import OutputEstimates
from engine_sidecar.gateway.config import GatewayConfig
from engine_sidecar.gateway.intake.openai_request import Kind
from engine_sidecar.gateway.policy.active import ActivePolicy, PolicyHolder
from engine_sidecar.gateway.relay.affinity import affinity_headers
from engine_sidecar.gateway.relay.exchange import (
    REQUEST_DROP,
    Upstream,
    UpstreamResponse,
    exchange,
    request_headers,
    server_timing,
)
from engine_sidecar.gateway.relay.output_meter import OutputMeter
from engine_sidecar.gateway.telemetry.metrics import GatewayMetrics
from engine_sidecar.gateway.telemetry.observer import NO_TRACE, RequestTrace

JSON_HEADERS = [(b"content-type", b"application/json")]
QUEUE_HEADER = b"x-kvquota-queue-ms"  # on admitted responses: time spent in the queue


class Relay:
    def __init__(self, config: GatewayConfig, upstream: Upstream, holder: PolicyHolder,
                 metrics: GatewayMetrics, estimates: OutputEstimates,
                 pace: DecodePace | None = None) -> None:
        self.upstream = upstream
        self.holder = holder
        self.metrics = metrics
        self.estimates = estimates
        self.pace = pace if pace is not None else DecodePace()  # streams teach it
        self._drop = frozenset(REQUEST_DROP | config.extra_request_drop | {b"content-type"})
        # On a leased session's admitted responses: the engine that will hold its KV,
        # calling the session back (the token) or not (the token cleared).
        self._affinity = {
            call_back: affinity_headers(config.engine_id, config.engine_namespace,
                                        call_back=call_back)
            for call_back in (True, False)}

    async def run(
        self, scope: Scope, receive: Receive, send: Send, admitted: Admitted, kind: Kind,
        active: ActivePolicy, tenant_id: str, arrived: float,
        trace: RequestTrace = NO_TRACE,
    ) -> int | None:
        """Relay the exchange to its end; the status the client got (None: none)."""
        reservation, tier = admitted.reservation, admitted.tier
        extra_headers = [(QUEUE_HEADER, str(round(admitted.waited * 1000)).encode()),
                         server_timing("admit", arrived)]
        if admitted.call_back is not None:  # a leased session: decided at admission
            extra_headers.extend(self._affinity[admitted.call_back])
        outcome = "cancelled"
        meter = OutputMeter(kind.value)
        upstream = self.upstream
        path, body = scope["path"], admitted.body
        headers = self.forward_headers(scope)

        async def open_engine() -> UpstreamResponse:
            sent = trace.upstream_started("POST", upstream.base_url, path, headers)
            try:
                response = await upstream.open("POST", path, sent, body)
            except BaseException as error:
                trace.upstream_failed(error)
                raise
            trace.upstream_opened()
            return response

        sequences = admitted.sequences

        def on_chunk(chunk: bytes) -> None:
            meter.feed(chunk)
            reservation.progress(meter.decoded(sequences))  # re-estimates once per block

        try:
            result = await exchange(
                receive, send, upstream, open_engine,
                on_done=reservation.release,
                extra_headers=extra_headers,
                on_chunk=on_chunk,
            )
            outcome = result.outcome
            produced = meter.output_tokens(admitted.sequences)
            if outcome == "completed" and produced is not None:
                self.estimates.observe(tenant_id, kind.value, produced, admitted.sequences)
                if result.ttft is not None and meter.decoded(sequences):  # it streamed
                    self.pace.observe(result.ttft, result.duration, produced / sequences)
            series = self.metrics.tier(tier)
            if result.ttft is not None:
                series.ttft.observe(result.ttft)
            series.duration.observe(result.duration)
            return result.sent_status
        finally:
            reservation.release(outcome)
            self.metrics.reservations.labels(tier, outcome).inc()

    def forward_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The client's headers the engine gets, and the JSON content type."""
        drop: frozenset[bytes] | set[bytes] = self._drop
        active = self.holder.active
        if active is not None and active.auth.trusted_header is not None:
            drop = {*drop, active.auth.trusted_header}
        return [*request_headers(scope["headers"], drop), *JSON_HEADERS]

