"""The TenantQuota kind: one tenant's KV-cache quota, lease, request limits and
prefix-cache isolation in a pool (spec), and its effective settings, usage and
counters (status).

These models are the CRD's source of truth (`kvquota crds` generates it); `Usage` and
`Counters` mirror the sidecars' wire models field for field.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, Field

from engine_sidecar.contract.names import API_VERSION, ApiVersion
from engine_sidecar.contract.policy import (
    DEFAULT_ABOVE_MAX,
    TENANT_ID_PATTERN,
    AboveMax,
    Isolation,
    Tier,
)
from engine_sidecar.contract.stats import TenantCounters, TenantUsage
from kvquota.api.conditions import Conditions
from kvquota.api.meta import ApiModel, LocalObjectRef, ObjectMeta, with_cel_rules


class LeaseSpec(ApiModel):
    """Keeping an idle session's KV blocks pinned between turns, so its next turn is a
    prefix-cache hit. The caps are pool-wide; each engine enforces them divided by the
    ready engines, rounded up."""

    seconds: int | None = Field(
        None, ge=0, le=86_400,
        description="How long (seconds) a lease may last after the session's last "
        "activity (0: no lease). Overrides the tier's.",
    )
    max_sessions: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Sessions that may hold a lease at once, pool-wide (unset or 0: no cap).",
    )
    max_leased_blocks: int | None = Field(
        None, ge=0, le=100_000_000, alias="maxBlocks",
        description="Distinct KV blocks the tenant's leases may pin, pool-wide (unset or 0: "
        "no cap).",
    )


class TenantKVCacheSpec(BaseModel):
    """The tenant's KV-cache quota in KV blocks, pool-wide. The operator splits it evenly
    over the pool's ready engines: guarantees rounded down, ceilings rounded up."""

    model_config = with_cel_rules(
        (
            "self.maxBlocks >= self.guaranteedBlocks",
            "maxBlocks must be >= guaranteedBlocks",
            "'maxBlocks (%d) must be >= guaranteedBlocks (%d)'"
            ".format([self.maxBlocks, self.guaranteedBlocks])",
        ),
        (
            "!has(self.lease.maxBlocks) || self.lease.maxBlocks <= self.maxBlocks",
            "lease.maxBlocks must be <= maxBlocks",
            "'lease.maxBlocks (%d) must be <= maxBlocks (%d)'"
            ".format([self.lease.maxBlocks, self.maxBlocks])",
        ),
    )
    guaranteed_blocks: int = Field(
        0, ge=0, le=100_000_000,
        description="KV blocks reserved for the tenant. Granted (condition Accepted) when "
        "it fits, after the older TenantQuotas' guarantees, in the pool's capacity times "
        "(1 - watermark).",
    )
    max_blocks: int = Field(
        ge=0, le=100_000_000,
        description="Most KV blocks the tenant's requests may hold; beyond guaranteedBlocks "
        "they borrow free capacity.",
    )
    above_max: AboveMax = Field(
        DEFAULT_ABOVE_MAX,
        description="Reclaimable: at maxBlocks, the tenant's further requests may still run "
        "in free blocks above the watermark while no other tenant's request waits for "
        "capacity; that work is the first to be preempted when another tenant needs the "
        "blocks. Never: maxBlocks is a hard ceiling (for quotas that bill or cap by it).",
    )
    lease: LeaseSpec = Field(default_factory=LeaseSpec)


class LimitsSpec(BaseModel):
    """Request limits; an unset one takes the tier's value or, where the tier has none,
    is no limit."""

    model_config = with_cel_rules(
        (
            "!has(self.defaultMaxTokens) || !has(self.maxTokens) || "
            "self.defaultMaxTokens <= self.maxTokens",
            "limits.defaultMaxTokens must be <= limits.maxTokens",
        )
    )
    max_tokens: int | None = Field(
        None, ge=1, le=1_048_576,
        description="Ceiling max_tokens is clamped to (overrides the tier's).",
    )
    default_max_tokens: int | None = Field(
        None, ge=1, le=1_048_576,
        description="max_tokens for a request that sends none (overrides the tier's; at "
        "most the effective maxTokens).",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, le=10_485_760,
        description="Longest prompt a request may send, in tokens; a longer one gets 400. "
        "Unset: only the model's context limits it.",
    )
    max_concurrent_requests: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Requests in flight at once, pool-wide; more wait in the queue. Unset: "
        "no limit.",
    )
    max_queued_requests: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Requests that may wait for admission at once, pool-wide (overrides "
        "the tier's).",
    )


class PrefixCacheSpec(ApiModel):
    """Whether the tenant's prompts share vLLM's prefix cache with other tenants."""

    isolation: Isolation = Field(
        Isolation.TENANT,
        description="Tenant: the sidecar gives the tenant's requests their own cache_salt, "
        "so no other tenant can probe its prompts by timing. Shared: no salt, cached "
        "prefixes are shared.",
    )


class TenantQuotaSpec(BaseModel):
    model_config = with_cel_rules(
        (
            "!has(oldSelf.tenantId) || (has(self.tenantId) && self.tenantId == oldSelf.tenantId)",
            "tenantId is immutable",
        )
    )
    tenant_id: str | None = Field(
        None, max_length=63, pattern=TENANT_ID_PATTERN,
        description="The tenant, as the JWT's tenant claim names it. Defaults to "
        "metadata.name; immutable once set.",
    )
    pool_ref: LocalObjectRef = Field(
        description="The InferencePool, in this namespace, that serves the tenant."
    )
    tier: Tier = Field(
        description="premium, standard or free: the tenant's vLLM priority and the pool's "
        "defaults for its leases, token limits and queue."
    )
    kv_cache: TenantKVCacheSpec
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    prefix_cache: PrefixCacheSpec = Field(default_factory=PrefixCacheSpec)


class EffectiveSettings(ApiModel):
    """The tenant's settings as resolved and rendered into the pool's policy: tier
    defaults, then the pool's tier overrides, then this TenantQuota's. Pool-wide figures,
    with the per-engine shares the engines enforce."""

    tenant_id: str | None = Field(None, description="spec.tenantId, or metadata.name.")
    tier: Tier | None = Field(None, description="The tenant's tier.")
    priority: int | None = Field(None, description="vLLM priority; 0 runs first.")
    guaranteed_blocks: int | None = Field(
        None, description="Guaranteed KV blocks granted, pool-wide (0 while not Accepted)."
    )
    max_blocks: int | None = Field(None, description="The KV-block ceiling, pool-wide.")
    replicas: int | None = Field(
        None, description="Ready engines the quotas are split over (at least 1)."
    )
    guaranteed_blocks_per_engine: int | None = Field(
        None, description="guaranteedBlocks / replicas, rounded down."
    )
    max_blocks_per_engine: int | None = Field(
        None, description="maxBlocks / replicas, rounded up (at least the per-engine "
        "guarantee).",
    )
    lease_seconds: int | None = Field(
        None, description="Longest lease of an idle session, in seconds (0: no lease)."
    )
    lease_max_sessions: int | None = Field(
        None, description="Leased sessions at once, pool-wide (0: no cap)."
    )
    max_leased_blocks: int | None = Field(
        None, alias="leaseMaxBlocks",
        description="KV blocks the leases may pin, pool-wide (0: no cap).",
    )
    max_tokens: int | None = Field(None, description="Ceiling max_tokens is clamped to.")
    default_max_tokens: int | None = Field(
        None, description="max_tokens for a request that sends none."
    )
    max_prompt_tokens: int | None = Field(
        None, description="Longest prompt in tokens; absent: no limit of its own."
    )
    max_concurrent_requests: int | None = Field(
        None, description="Requests in flight at once, pool-wide; absent: no limit."
    )
    max_queue_seconds: int | None = Field(
        None, description="How long a request may wait for admission, in seconds."
    )
    max_queued_requests: int | None = Field(
        None, description="Requests that may wait for admission at once, pool-wide."
    )
    prefix_cache_isolation: Isolation | None = Field(
        None, description="Tenant (own cache_salt) or Shared."
    )
    above_max: AboveMax | None = Field(
        None, description="Reclaimable (may run into idle KV beyond maxBlocks) or Never."
    )


class _WireView(ApiModel):
    """A status field that shows (part of) a model the sidecars report (`WIRE`, from
    `engine_sidecar.contract.stats`): each field is the wire field of the same name and
    type, documented for the CRD. `of` builds the view from a wire object."""

    WIRE: ClassVar[type[BaseModel]]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        wire = cls.WIRE.model_fields
        wrong = [name for name, field in cls.model_fields.items()
                 if name not in wire or wire[name].annotation != field.annotation]
        if wrong:
            raise TypeError(f"{cls.__name__} fields not in {cls.WIRE.__name__} as such: {wrong}")

    @classmethod
    def of(cls, wire: BaseModel) -> Self:
        if not isinstance(wire, cls.WIRE):
            raise TypeError(f"{cls.__name__} shows a {cls.WIRE.__name__}, not {wire!r}")
        return cls.model_validate(wire, from_attributes=True)


class Usage(_WireView):
    """What the engines reported at the operator's last poll, summed over the engines
    that answered."""

    WIRE = TenantUsage

    blocks: int = Field(
        0, description="KV blocks the tenant holds: its running requests' and its idle "
        "leases' (the sidecars' reservations where the scheduler's stats are missing).",
    )
    reserved_blocks: int = Field(
        0, description="KV blocks the sidecars charge the tenant's requests in flight: what "
        "they take now (prompts and tokens decoded so far) plus one bound on how far that "
        "will still grow together (max_tokens less what each decoded for a tier whose "
        "reservation is Full).",
    )
    pending_blocks: int = Field(
        0, description="KV blocks charged for the tenant's work not allocated yet "
        "(the bound on its requests' growth, and prompts not scheduled yet).",
    )
    charged_blocks: int = Field(
        0, description="KV blocks counted against maxBlocks: what the tenant's running "
        "requests hold plus pendingBlocks; chargedBlocks / blocks is what admission charges "
        "beyond what the tenant holds.",
    )
    output_estimate_tokens: int = Field(
        0, description="Output tokens a request of the tenant reserves now: the 90th "
        "percentile of its recent answers, the tier's defaultMaxTokens until enough "
        "finished, maxTokens for a tier whose reservation is Full (the largest over the "
        "engines).",
    )
    above_max_blocks: int = Field(
        0, description="Of chargedBlocks, those beyond the tenant's maxBlocks on each engine: "
        "work run in KV no other tenant wanted (aboveMax: Reclaimable), the first to be "
        "preempted when another tenant needs the blocks.",
    )
    leased_blocks: int = Field(
        0, description="KV blocks idle leases pin that no running request holds."
    )
    leased_sessions: int = Field(0, description="Sessions holding a lease.")
    inflight: int = Field(0, description="Admitted requests not yet finished.")
    queued: int = Field(0, description="Requests waiting in the sidecars' queues.")
    queue_wait_seconds: float = Field(
        0.0, description="How long the oldest queued request has waited, in seconds (the "
        "longest over the engines).",
    )


class Counters(_WireView):
    """Cumulative counts per engine, summed over the engines that answered the operator's
    last poll; an engine that restarts counts from 0 again."""

    WIRE = TenantCounters

    admitted: int = Field(0, description="Requests the sidecars admitted.")
    rejected_quota: int = Field(
        0, description="Requests refused for the tenant's block quota or concurrency limit."
    )
    rejected_watermark: int = Field(
        0, description="Requests refused with 503 because free blocks were below the "
        "watermark.",
    )
    preemptions: int = Field(
        0, description="Running requests preempted and leases broken to free KV blocks."
    )
    outgrown_preemptions: int = Field(
        0, description="Of the preemptions, those of requests that held more KV blocks than "
        "the sidecar reserved for them (they decoded past their output estimate).",
    )
    lease_breaks: int = Field(
        0, description="Leases released early to free KV blocks (not lapsed or capped)."
    )


class EngineSplitStatus(ApiModel):
    """The tenant's blocks on one ready engine (even, or moved by the demand split)."""

    pod: str = Field(max_length=253, description="The engine pod.")
    guaranteed_blocks: int = Field(0, ge=0, description="Blocks guaranteed on this engine.")
    max_blocks_per_engine: int = Field(0, ge=0, alias="maxBlocks",
                                       description="The tenant's ceiling on this engine.")


MAX_STATUS_ENGINES = 1024  # a longer pool lists its first engines by name


class TenantQuotaStatus(ApiModel):
    observed_generation: int | None = Field(
        None, description="The metadata.generation this status was computed from."
    )
    conditions: Conditions = Field(
        description="Accepted (the guarantee fits the pool), Ready (the settings run on "
        "every ready engine), Degraded (lease breaks, premium preemptions or degraded-mode "
        "releases in the recent window)."
    )
    effective: EffectiveSettings | None = None
    engines: list[EngineSplitStatus] | None = Field(
        None, max_length=MAX_STATUS_ENGINES,
        description="The per-engine split of the quota over the pool's ready engines "
        "(sorted by pod): the even split, moved toward the engines where the tenant's "
        "demand is (the demand-driven split).",
        json_schema_extra={"x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["pod"]},
    )
    usage: Usage | None = None
    counters: Counters | None = None
    last_sync_time: datetime | None = Field(
        None, description="When Ready last turned True: the settings reached every ready "
        "engine.",
    )


class TenantQuota(ApiModel):
    api_version: ApiVersion = API_VERSION
    kind: Literal["TenantQuota"] = "TenantQuota"
    metadata: ObjectMeta
    spec: TenantQuotaSpec
    status: TenantQuotaStatus | None = None

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id or self.metadata.name
