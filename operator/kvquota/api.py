"""The v1alpha1 API: `InferencePool` and `TenantQuota` (spec and status).

These models are the source of truth for the CRDs (`kvquota crds` generates them):
defaults, bounds and patterns come from the fields, CEL rules from `_rules(...)`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

from engine_sidecar.policy import (
    MAX_TOKEN_LIFETIME_SECONDS,
    TENANT_ID_PATTERN,
    Isolation,
    JwtAlgorithm,
    Tier,
    default_algorithms,
)

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
Name = Annotated[str, Field(min_length=1, max_length=253, pattern=NAME_PATTERN)]
ShortString = Annotated[str, Field(max_length=256)]
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


def _rules(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Config for a model whose object carries CEL rules: (rule, message) or (rule,
    message, messageExpression). The API server shows the messageExpression's value
    (so it can quote the bad value), and the static message if that fails."""
    validations: list[JsonValue] = []
    for rule, message, *expression in rules:
        validation: dict[str, JsonValue] = {"rule": rule, "message": message}
        if expression:
            validation["messageExpression"] = expression[0]
        validations.append(validation)
    return ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra={"x-kubernetes-validations": validations},
    )


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# ---------------------------------------------------------------- shared pieces


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = Field(None, ge=0)
    last_transition_time: datetime
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)
    message: str = Field("", max_length=32768)


Conditions = Annotated[
    list[Condition],
    Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    ),
]


class LocalObjectRef(_Model):
    name: Name


class SecretKeyRef(_Model):
    name: Name
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class LabelSelectorRequirement(_Model):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list, max_length=64
    )


class LabelSelector(BaseModel):
    model_config = _rules(
        (
            "size(self.matchLabels) + size(self.matchExpressions) > 0",
            "selector must have matchLabels or matchExpressions",
        )
    )
    match_labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, json_schema_extra={"maxProperties": 32}
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16
    )


# ---------------------------------------------------------------- InferencePool


# vLLM's own config takes any positive --block-size; its attention kernels need a
# multiple of 16 (FlashAttention, Triton: MultipleOf(16)) or 32 (the CPU backend).
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 2048  # vLLM sets no maximum: this one catches a typo such as 16384


class KVCacheSpec(BaseModel):
    model_config = _rules(
        (
            "self.watermark >= 0.0 && self.watermark < 0.5",
            "kvCache.watermark must be >= 0 and < 0.5",
            "'kvCache.watermark must be >= 0 and < 0.5, got ' + string(self.watermark)",
        ),
    )
    block_size: int = Field(
        16, ge=BLOCK_SIZE_MULTIPLE, le=MAX_BLOCK_SIZE, multiple_of=BLOCK_SIZE_MULTIPLE,
        description="vLLM --block-size (tokens): the same value as the engines' flag, a "
        f"multiple of {BLOCK_SIZE_MULTIPLE} (32 on CPU).",
    )
    capacity_blocks: int | None = Field(
        None, ge=1, le=100_000_000,
        description="KV blocks per engine; when unset, the minimum the engines report.",
    )
    watermark: float = Field(
        0.15, description="Free-block fraction below which borrowing requests get 503."
    )


class TierSpec(BaseModel):
    """Overrides of one tier's built-in defaults (see `TIER_DEFAULTS`)."""

    model_config = _rules(
        (
            "!has(self.defaultMaxTokens) || !has(self.maxTokens) || "
            "self.defaultMaxTokens <= self.maxTokens",
            "defaultMaxTokens must be <= maxTokens",
        )
    )
    priority: int | None = Field(None, ge=0, le=2, description="vLLM priority; 0 runs first.")
    lease_seconds: int | None = Field(None, ge=0, le=86_400)
    max_tokens: int | None = Field(
        None, ge=1, le=1_048_576, description="Ceiling max_tokens is clamped to."
    )
    default_max_tokens: int | None = Field(None, ge=1, le=1_048_576)
    max_queue_seconds: int | None = Field(
        None, ge=0, le=3600,
        description="How long a request the sidecar cannot admit yet waits in its "
        "tenant's queue before it is refused with 429/503 (0: refused at once).",
    )
    max_queued_requests: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Requests one tenant of the tier may have waiting, pool-wide.",
    )


class TiersSpec(_Model):
    premium: TierSpec = Field(default_factory=TierSpec)
    standard: TierSpec = Field(default_factory=TierSpec)
    free: TierSpec = Field(default_factory=TierSpec)


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


class PreemptionSpec(_Model):
    recompute_below_blocks: int = Field(
        128, ge=0, le=1_000_000,
        description="With KV offloading configured, swap victims holding more blocks.",
    )


class JwtSpec(BaseModel):
    model_config = _rules(
        (
            "self.algorithms.all(a, a.startsWith('HS')) || "
            "self.algorithms.all(a, !a.startsWith('HS'))",
            "jwt.algorithms must not mix HMAC (HS*) with public-key algorithms",
        )
    )
    secret_ref: SecretKeyRef
    algorithms: list[JwtAlgorithm] = Field(
        default_factory=default_algorithms, min_length=1, max_length=8
    )
    issuer: ShortString | None = None
    audience: ShortString | None = None
    tenant_claim: str = Field("tenant_id", min_length=1, max_length=128)
    max_token_lifetime_seconds: int | None = Field(
        None, ge=1, le=MAX_TOKEN_LIFETIME_SECONDS,
        description="Refuse tokens whose exp is further than this many seconds ahead, or "
        "whose exp - iat is larger. Unset: any lifetime (the sidecar still re-verifies a "
        "cached token every few minutes).",
    )


class AnonymousSpec(BaseModel):
    model_config = _rules(
        ("!self.allowed || has(self.tenantId)", "anonymous.tenantId is required when allowed")
    )
    allowed: bool = False
    tenant_id: str | None = Field(None, max_length=63, pattern=TENANT_ID_PATTERN)


class AuthSpec(_Model):
    jwt: JwtSpec | None = None
    anonymous: AnonymousSpec = Field(default_factory=AnonymousSpec)
    trusted_tenant_header: str | None = Field(
        None, max_length=128, pattern=r"^[A-Za-z0-9-]+$",
        description="Take the tenant from this header (only behind a trusted gateway).",
    )


class InferencePoolSpec(BaseModel):
    model_config = _rules(
        (
            "has(self.selector) != has(self.gatewayPoolRef)",
            "exactly one of selector or gatewayPoolRef must be set",
        )
    )
    selector: LabelSelector | None = None
    gateway_pool_ref: LocalObjectRef | None = None
    model: str = Field(min_length=1, max_length=512)
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    tiers: TiersSpec = Field(default_factory=TiersSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)


class EngineCounts(_Model):
    ready: int = 0
    synced: int = 0


class InferencePoolStatus(_Model):
    observed_generation: int | None = None
    conditions: Conditions
    engines: EngineCounts = Field(default_factory=EngineCounts)
    capacity_blocks: int | None = None
    guaranteed_blocks: int | None = None
    used_blocks: int | None = None
    leased_blocks: int | None = None
    tenants: int | None = None
    policy_hash: str | None = Field(None, max_length=128)


# ---------------------------------------------------------------- TenantQuota


class LeaseSpec(_Model):
    seconds: int | None = Field(None, ge=0, le=86_400, description="Overrides the tier's.")
    max_sessions: int | None = Field(None, ge=0, le=1_000_000)
    max_blocks: int | None = Field(None, ge=0, le=100_000_000)


class TenantKVCacheSpec(BaseModel):
    model_config = _rules(
        (
            "self.maxBlocks >= self.guaranteedBlocks",
            "maxBlocks must be >= guaranteedBlocks",
            "'maxBlocks (' + string(self.maxBlocks) + ') must be >= guaranteedBlocks (' "
            "+ string(self.guaranteedBlocks) + ')'",
        ),
        (
            "!has(self.lease.maxBlocks) || self.lease.maxBlocks <= self.maxBlocks",
            "lease.maxBlocks must be <= maxBlocks",
            "'lease.maxBlocks (' + string(self.lease.maxBlocks) + ') must be <= maxBlocks (' "
            "+ string(self.maxBlocks) + ')'",
        ),
    )
    guaranteed_blocks: int = Field(0, ge=0, le=100_000_000)
    max_blocks: int = Field(ge=0, le=100_000_000)
    lease: LeaseSpec = Field(default_factory=LeaseSpec)


class LimitsSpec(BaseModel):
    model_config = _rules(
        (
            "!has(self.defaultMaxTokens) || !has(self.maxTokens) || "
            "self.defaultMaxTokens <= self.maxTokens",
            "limits.defaultMaxTokens must be <= limits.maxTokens",
        )
    )
    max_tokens: int | None = Field(None, ge=1, le=1_048_576)
    default_max_tokens: int | None = Field(None, ge=1, le=1_048_576)
    max_prompt_tokens: int | None = Field(None, ge=1, le=10_485_760)
    max_concurrent_requests: int | None = Field(None, ge=1, le=1_000_000)
    max_queued_requests: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Requests that may wait for admission at once, pool-wide (overrides "
        "the tier's).",
    )


class PrefixCacheSpec(_Model):
    isolation: Isolation = Isolation.TENANT


class TenantQuotaSpec(BaseModel):
    model_config = _rules(
        (
            "!has(oldSelf.tenantId) || (has(self.tenantId) && self.tenantId == oldSelf.tenantId)",
            "tenantId is immutable",
        )
    )
    tenant_id: str | None = Field(
        None, max_length=63, pattern=TENANT_ID_PATTERN,
        description="Defaults to metadata.name.",
    )
    pool_ref: LocalObjectRef
    tier: Tier
    kv_cache: TenantKVCacheSpec
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    prefix_cache: PrefixCacheSpec = Field(default_factory=PrefixCacheSpec)


class EffectiveSettings(_Model):
    tenant_id: str | None = None
    tier: Tier | None = None
    priority: int | None = None
    guaranteed_blocks: int | None = None
    max_blocks: int | None = None
    replicas: int | None = None
    guaranteed_blocks_per_engine: int | None = None
    max_blocks_per_engine: int | None = None
    lease_seconds: int | None = None
    lease_max_sessions: int | None = None
    lease_max_blocks: int | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    max_concurrent_requests: int | None = None
    max_queue_seconds: int | None = None
    max_queued_requests: int | None = None
    prefix_cache_isolation: Isolation | None = None


class Usage(_Model):
    blocks: int = 0
    reserved_blocks: int = 0
    leased_blocks: int = 0
    leased_sessions: int = 0
    inflight: int = 0
    queued: int = Field(0, description="Requests waiting in the sidecars' queues.")
    queue_wait_seconds: float = Field(
        0.0, description="How long the oldest queued request has waited."
    )


class Counters(_Model):
    admitted: int = 0
    rejected_quota: int = 0
    rejected_watermark: int = 0
    preemptions: int = 0
    lease_breaks: int = 0


class EngineSplitStatus(_Model):
    """The tenant's blocks on one ready engine (even, or moved by the demand split)."""

    pod: str = Field(max_length=253, description="The engine pod.")
    guaranteed_blocks: int = Field(0, ge=0, description="Blocks guaranteed on this engine.")
    max_blocks: int = Field(0, ge=0, description="The tenant's ceiling on this engine.")


MAX_STATUS_ENGINES = 1024  # a longer pool lists its first engines by name


class TenantQuotaStatus(_Model):
    observed_generation: int | None = None
    conditions: Conditions
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
    last_sync_time: datetime | None = None


# ---------------------------------------------------------------- objects


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta the operator reads; the rest passes through."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    name: str
    namespace: str = "default"
    generation: int | None = None
    uid: str | None = None
    creation_timestamp: datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferencePool(_Model):
    api_version: Literal["kvquota.dev/v1alpha1"] = "kvquota.dev/v1alpha1"
    kind: Literal["InferencePool"] = "InferencePool"
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None


class TenantQuota(_Model):
    api_version: Literal["kvquota.dev/v1alpha1"] = "kvquota.dev/v1alpha1"
    kind: Literal["TenantQuota"] = "TenantQuota"
    metadata: ObjectMeta
    spec: TenantQuotaSpec
    status: TenantQuotaStatus | None = None

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id or self.metadata.name
