"""Tiers: each tier's built-in defaults and the pool's overrides of them.

Precedence (most specific wins): a TenantQuota's own limits and lease, then its pool's
`spec.tiers.<tier>`, then `TIER_DEFAULTS` (resolved in `kvquota.policy.resolve`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from engine_sidecar.contract.policy import (
    ReservationMode,
    Tier,
)
from kvquota.api.meta import ApiModel, with_cel_rules


class TierDefaults(NamedTuple):
    """A tier's settings when the pool does not override them."""

    priority: int
    lease_seconds: int
    max_tokens: int
    default_max_tokens: int
    max_queue_seconds: int
    max_queued_requests: int


# Queue bounds: long, because a refusal makes the client start over; premium waits
# longest (it would rather wait than fail), free least.
TIER_DEFAULTS: dict[Tier, TierDefaults] = {
    Tier.PREMIUM: TierDefaults(0, 300, 4096, 1024, 120, 1024),
    Tier.STANDARD: TierDefaults(1, 60, 2048, 512, 60, 512),
    Tier.FREE: TierDefaults(2, 0, 512, 256, 30, 256),
}


class TierSpec(BaseModel):
    """Overrides of one tier's built-in defaults (see `TIER_DEFAULTS`); an unset field
    keeps the default."""

    model_config = with_cel_rules(
        (
            "!has(self.defaultMaxTokens) || !has(self.maxTokens) || "
            "self.defaultMaxTokens <= self.maxTokens",
            "defaultMaxTokens must be <= maxTokens",
        )
    )
    priority: int | None = Field(None, ge=0, le=2, description="vLLM priority; 0 runs first.")
    lease_seconds: int | None = Field(
        None, ge=0, le=86_400,
        description="How long (seconds) an idle session's KV blocks stay pinned after its "
        "request finishes, so its next turn reuses them (0: no lease).",
    )
    max_tokens: int | None = Field(
        None, ge=1, le=1_048_576, description="Ceiling max_tokens is clamped to."
    )
    default_max_tokens: int | None = Field(
        None, ge=1, le=1_048_576,
        description="max_tokens for a request that sends none (at most maxTokens).",
    )
    max_queue_seconds: int | None = Field(
        None, ge=0, le=3600,
        description="How long a request the sidecar cannot admit yet waits in its "
        "tenant's queue before it is refused with 429/503 (0: refused at once).",
    )
    max_queued_requests: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Requests one tenant of the tier may have waiting, pool-wide.",
    )
    reservation: ReservationMode | None = Field(
        None,
        description="What the sidecar charges a tenant of the tier for its requests' "
        "output. Estimated (the default): one charge per tenant for its requests together "
        "on each engine: what they take now (prompts and tokens decoded so far) plus a "
        "bound on how far that will still grow, read from its tenant's latest 64 answer "
        "lengths on the route beyond what each has decoded (the peak over the tokens "
        "ahead of their expected joint growth, finished requests giving their blocks "
        "back, plus two standard deviations; with fewer than 4 in flight, their own "
        "90th percentiles; defaultMaxTokens until 8 have finished); requests that outgrow "
        "it are charged the blocks they really hold, drawing on their tenant's headroom "
        "up to maxBlocks, then on free KV above the watermark, and when both are gone the "
        "plugin's victim order decides. Full: its prompt plus max_tokens, so no admitted "
        "request is ever preempted for growing, at the price "
        "of KV reserved that requests with short answers never use.",
    )


def _tier_field(tier: Tier) -> Any:
    d = TIER_DEFAULTS[tier]
    return Field(
        default_factory=TierSpec,
        description=f"Overrides of the {tier.value} tier's defaults: priority {d.priority}, "
        f"leaseSeconds {d.lease_seconds}, maxTokens {d.max_tokens}, defaultMaxTokens "
        f"{d.default_max_tokens}, maxQueueSeconds {d.max_queue_seconds}, "
        f"maxQueuedRequests {d.max_queued_requests}.",
    )


class TiersSpec(ApiModel):
    """Per-tier settings for this pool's tenants; a TenantQuota's own limits and lease
    override its tier's."""

    premium: TierSpec = _tier_field(Tier.PREMIUM)
    standard: TierSpec = _tier_field(Tier.STANDARD)
    free: TierSpec = _tier_field(Tier.FREE)
