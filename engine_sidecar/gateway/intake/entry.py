"""A request's way in: the policy it is judged by, its tenant, its body.

Every route that needs a tenant goes through here (generation, /v1/models, the
passthrough routes that take credentials): the active policy (503 before one is
loaded), authentication from the headers alone, then the body, capped for the tenant
and read under a deadline. Each refusal is counted by reason.
"""

from __future__ import annotations

from starlette.types import Receive, Scope

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.rules import Decision
from engine_sidecar.gateway.config import GatewayConfig
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.body import body_limit, declared_length, read_body
from engine_sidecar.gateway.policy.active import ActivePolicy, PolicyHolder
from engine_sidecar.gateway.telemetry.metrics import GatewayMetrics
from engine_sidecar.gateway.telemetry.observer import NO_TRACE, RequestTrace


class Intake:
    def __init__(self, config: GatewayConfig, holder: PolicyHolder,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.holder = holder
        self.metrics = metrics

    def reject(self, error: ApiError, reason: str) -> ApiError:
        """`error`, counted as a refusal for `reason`."""
        self.metrics.rejections.labels(reason).inc()
        return error

    def active(self) -> ActivePolicy:
        """The policy requests are judged by; 503 before one is loaded."""
        active = self.holder.active
        if active is None:
            raise self.reject(ApiError(
                503, errors.POLICY_NOT_LOADED,
                "the sidecar has no valid policy yet; check the pool's status",
                retry_after=self.config.retry_after_seconds,
            ), "not_ready")
        return active

    def authenticate(self, active: ActivePolicy, headers: list[tuple[bytes, bytes]],
                     trace: RequestTrace = NO_TRACE) -> str:
        """The tenant the headers' credentials name (401/403/400 otherwise)."""
        trace.auth_started()
        try:
            tenant_id = active.auth.authenticate(headers)
        except ApiError as error:
            self.metrics.admissions.labels("unknown", "", Decision.REJECTED_AUTH).inc()
            reason = {400: "invalid_request", 403: "unknown_tenant"}.get(
                error.status, "unauthenticated")
            trace.auth_ended(None, error)
            raise self.reject(error, reason) from None
        trace.auth_ended(tenant_id, None)
        return tenant_id

    def body_limit(self, active: ActivePolicy, tenant_id: str, *, chat: bool) -> int:
        """The largest body the tenant may send (`body.body_limit`)."""
        return body_limit(
            active.policy.tenants[tenant_id], block_size=active.policy.block_size,
            chat=chat, cap=self.config.max_body_bytes,
            bytes_per_token=self.config.body_bytes_per_token,
        )

    async def read_body(self, scope: Scope, receive: Receive, limit: int) -> bytes | None:
        """The whole body within `limit` bytes and the body deadline (413, 408); None if
        the client went away first."""
        return await read_body(receive, limit, self.config.body_timeout,
                               declared_length(scope))

    async def read_prompt_body(self, scope: Scope, receive: Receive, active: ActivePolicy,
                               tenant_id: str, chat: bool) -> bytes | None:
        """A generation request's body, its refusals counted."""
        try:
            return await self.read_body(scope, receive,
                                        self.body_limit(active, tenant_id, chat=chat))
        except ApiError as error:
            raise self.reject(error, "too_large" if error.status == 413 else "slow_body"
                              ) from None
