"""The v1alpha1 API: `InferencePool` and `TenantQuota` (spec and status).

These models are the source of truth for the CRDs (`kvquota crds` generates them):
defaults, bounds and patterns come from the fields, CEL rules from `_rules(...)`.
`ConditionType` and `ConditionReason` name every condition the operator writes.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

from engine_sidecar.contract.names import API_VERSION, ApiVersion
from engine_sidecar.contract.policy import (
    DEFAULT_ABOVE_MAX,
    MAX_TOKEN_LIFETIME_SECONDS,
    TENANT_ID_PATTERN,
    AboveMax,
    Isolation,
    JwtAlgorithm,
    ReservationMode,
    Tier,
    default_algorithms,
)
from engine_sidecar.contract.stats import TenantCounters, TenantUsage

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


# ---------------------------------------------------------------- conditions


class ConditionType(StrEnum):
    """The condition types the operator writes (`Condition.type`); each kind carries all
    of its own from the first reconcile."""

    ACCEPTED = "Accepted"
    """TenantQuota: the guarantee fits the pool (or no capacity is known yet: Unknown)."""
    READY = "Ready"
    """TenantQuota: the settings run on every ready engine. InferencePool: engine pods
    are found and ready."""
    DEGRADED = "Degraded"
    """TenantQuota: lease breaks, premium preemptions or degraded-mode releases in the
    recent window."""
    SYNCED = "Synced"
    """InferencePool: every ready engine runs the current policy."""
    OVERSUBSCRIBED = "Oversubscribed"
    """InferencePool: the TenantQuotas ask for more guaranteed blocks than the pool can
    guarantee."""
    STORE_DEGRADED = "StoreDegraded"
    """InferencePool with spec.poolStore: some ready engine's sidecar cannot reach the
    store, so it admits only what it had claimed of its split."""


class ConditionReason(StrEnum):
    """Why a condition has its status (`Condition.reason`): every reason the operator
    writes, grouped by the condition types that use it."""

    # Accepted (TenantQuota)
    ACCEPTED = "Accepted"
    """The guarantee is reserved in the pool."""
    MAX_BLOCKS_ABOVE_CAPACITY = "MaxBlocksAboveCapacity"
    """Accepted, but maxBlocks exceeds the pool's capacity, which is the real limit
    (posted as a Warning event)."""
    OVERSUBSCRIBED = "Oversubscribed"
    """The guarantee does not fit what older quotas left; the quota borrows only."""
    DUPLICATE_TENANT = "DuplicateTenant"
    """An older TenantQuota of the pool already uses the tenantId."""
    CAPACITY_UNKNOWN = "CapacityUnknown"
    """The pool's KV capacity is not known yet (Accepted and Oversubscribed: Unknown)."""

    # The object or its pool (Accepted, Ready, Oversubscribed)
    INVALID_SPEC = "InvalidSpec"
    """The object's spec (or the tenant's policy entry) does not validate."""
    POOL_NOT_FOUND = "PoolNotFound"
    """The TenantQuota's pool does not exist."""
    POOL_INVALID = "PoolInvalid"
    """The TenantQuota's pool has an invalid spec."""

    # Ready
    POLICY_RENDERED = "PolicyRendered"
    """Local mode: the policy is rendered; engines are not observed."""
    APPLIED = "Applied"
    """TenantQuota: its settings run on every ready engine."""
    NOT_SYNCED = "NotSynced"
    """TenantQuota: some ready engines do not run its settings yet."""
    NO_READY_ENGINES = "NoReadyEngines"
    """TenantQuota Ready, InferencePool Synced: no engine pod of the pool is ready."""
    NO_ENGINES = "NoEngines"
    """InferencePool: the selector matches no engine pod."""
    ENGINES_NOT_READY = "EnginesNotReady"
    """InferencePool: engine pods exist, none is ready."""
    ENGINES_READY = "EnginesReady"
    """InferencePool: some engine pods are ready."""
    GATEWAY_POOL_NOT_FOUND = "GatewayPoolNotFound"
    """InferencePool: the Gateway API InferencePool of spec.gatewayPoolRef is missing."""
    GATEWAY_POOL_INVALID = "GatewayPoolInvalid"
    """InferencePool: the Gateway API InferencePool has no label selector."""

    # Synced (InferencePool)
    ALL_ENGINES_SYNCED = "AllEnginesSynced"
    """Every ready engine runs the current policy."""
    ENGINES_NOT_SYNCED = "EnginesNotSynced"
    """Some ready engines run another policy, or none."""
    NO_POLICY = "NoPolicy"
    """No policy could be rendered."""
    NOT_OBSERVED = "NotObserved"
    """Local mode: engines are not observed (also Degraded)."""

    # Degraded (TenantQuota)
    NO_DATA = "NoData"
    """The engines have not reported for a whole window yet."""
    LEASE_BREAKS = "LeaseBreaks"
    """Leases were broken to free KV blocks in the window."""
    PREMIUM_PREEMPTIONS = "PremiumPreemptions"
    """A premium tenant's requests were preempted in the window."""
    DEGRADED_MODE = "DegradedMode"
    """Engines released the tenant's blocks in degraded mode in the window."""
    NO_DISRUPTIONS = "NoDisruptions"
    """None of the above in the window."""

    # Oversubscribed (InferencePool)
    GUARANTEES_EXCEED_CAPACITY = "GuaranteesExceedCapacity"
    """The TenantQuotas ask for more guaranteed blocks than the pool can guarantee."""
    WITHIN_CAPACITY = "WithinCapacity"
    """Every guarantee asked for fits."""


# ---------------------------------------------------------------- shared pieces
    # StoreDegraded (InferencePool)
    STORE_REACHABLE = "StoreReachable"
    """Every ready engine that reported reached the pool's store."""
    STORE_UNREACHABLE = "StoreUnreachable"
    """Some engine's sidecar could not reach the store within its timeout."""


class Condition(_Model):
    """One aspect of the object's state, as metav1.Condition."""

    type: str = Field(
        max_length=316, pattern=CONDITION_TYPE_PATTERN,
        description="The aspect the condition reports, in CamelCase (e.g. Ready).",
    )
    status: Literal["True", "False", "Unknown"] = Field(
        description="True, False, or Unknown when the operator cannot tell yet."
    )
    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation the condition was computed from."
    )
    last_transition_time: datetime = Field(
        description="When status last changed (not when the condition was last checked)."
    )
    reason: str = Field(
        min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN,
        description="Why the condition has its status: one CamelCase word, for programs.",
    )
    message: str = Field(
        "", max_length=32768, description="The reason explained for people; may be empty."
    )


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
    """A reference to an object in the same namespace."""

    name: Name = Field(description="The referenced object's name.")


class SecretKeyRef(_Model):
    """One key of a Secret in the same namespace."""

    name: Name = Field(description="The Secret's name.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key within the Secret.",
    )


class LabelSelectorRequirement(_Model):
    """One requirement on a pod label."""

    key: str = Field(min_length=1, max_length=317, description="The label's key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In/NotIn: the label's value is/is not one of values; "
        "Exists/DoesNotExist: the pod has/lacks the label, whatever its value."
    )
    values: list[Annotated[str, Field(max_length=63, description="A label value.")]] = Field(
        default_factory=list, max_length=64,
        description="The values In and NotIn compare with; empty for Exists and DoesNotExist.",
    )


class LabelSelector(BaseModel):
    """metav1.LabelSelector: a pod matches when it meets every matchLabels entry and
    every matchExpressions requirement."""

    model_config = _rules(
        (
            "size(self.matchLabels) + size(self.matchExpressions) > 0",
            "selector must have matchLabels or matchExpressions",
        )
    )
    match_labels: dict[
        str, Annotated[str, Field(max_length=63, description="The label's required value.")]
    ] = Field(
        default_factory=dict, json_schema_extra={"maxProperties": 32},
        description="Labels the pod must carry, each with exactly the given value.",
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16,
        description="Requirements on the pod's labels; the pod must meet all of them.",
    )


# ---------------------------------------------------------------- InferencePool


# vLLM's own config takes any positive --block-size; its attention kernels need a
# multiple of 16 (FlashAttention, Triton: MultipleOf(16)) or 32 (the CPU backend).
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 2048  # vLLM sets no maximum: this one catches a typo such as 16384


class KVCacheSpec(BaseModel):
    """The engines' KV cache as vLLM runs it, and the share kept free for borrowing."""

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
        0.15, description="Free-block fraction below which borrowing requests get 503. "
        "Guarantees may total at most the pool's capacity times (1 - watermark).",
    )


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

    model_config = _rules(
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


class TiersSpec(_Model):
    """Per-tier settings for this pool's tenants; a TenantQuota's own limits and lease
    override its tier's."""

    premium: TierSpec = _tier_field(Tier.PREMIUM)
    standard: TierSpec = _tier_field(Tier.STANDARD)
    free: TierSpec = _tier_field(Tier.FREE)


class PreemptionSpec(_Model):
    """What happens to the requests the scheduler plugin preempts."""

    recompute_below_blocks: int = Field(
        128, ge=0, le=1_000_000,
        description="With KV offloading configured, a preempted request holding at least "
        "this many KV blocks reloads them from the offload tier when it resumes; a smaller "
        "one recomputes them. Without offloading every victim recomputes.",
    )


class JwtSpec(BaseModel):
    """Bearer-token (JWT) authentication: the sidecar verifies each token and takes the
    tenant id from one of its claims."""

    model_config = _rules(
        (
            "self.algorithms.all(a, a.startsWith('HS')) || "
            "self.algorithms.all(a, !a.startsWith('HS'))",
            "jwt.algorithms must not mix HMAC (HS*) with public-key algorithms",
        )
    )
    secret_ref: SecretKeyRef = Field(
        description="The Secret key holding the verification key: a PEM public key or a "
        "JWKS, or the shared secret for HS* algorithms. The engine pods mount the Secret; "
        "the operator passes the sidecar only the key's name."
    )
    algorithms: list[
        Annotated[JwtAlgorithm, Field(description="A JWT signing algorithm (alg).")]
    ] = Field(
        default_factory=default_algorithms, min_length=1, max_length=8,
        description="The algorithms accepted; a token signed with any other gets 401. "
        "Either all HMAC (HS*) or all public-key.",
    )
    issuer: ShortString | None = Field(
        None, description="The iss claim every token must carry; unset: iss is not checked."
    )
    audience: ShortString | None = Field(
        None, description="The aud claim every token must carry; unset: aud is not checked."
    )
    tenant_claim: str = Field(
        "tenant_id", min_length=1, max_length=128,
        description="The claim holding the tenant id (a TenantQuota's tenantId).",
    )
    max_token_lifetime_seconds: int | None = Field(
        None, ge=1, le=MAX_TOKEN_LIFETIME_SECONDS,
        description="Refuse tokens whose exp is further than this many seconds ahead, or "
        "whose exp - iat is larger. Unset: any lifetime (the sidecar still re-verifies a "
        "cached token every few minutes).",
    )


class AnonymousSpec(BaseModel):
    """Requests that carry no token."""

    model_config = _rules(
        ("!self.allowed || has(self.tenantId)", "anonymous.tenantId is required when allowed")
    )
    allowed: bool = Field(
        False, description="Serve requests without a token (every request, when jwt is "
        "unset) as tenantId; false: they get 401.",
    )
    tenant_id: str | None = Field(
        None, max_length=63, pattern=TENANT_ID_PATTERN,
        description="The tenant anonymous requests count as (it needs a TenantQuota in this "
        "pool); required when allowed.",
    )


class AuthSpec(_Model):
    """How the sidecar learns each request's tenant."""

    jwt: JwtSpec | None = Field(
        None, description="Verify bearer tokens; unset: tokens are ignored."
    )
    anonymous: AnonymousSpec = Field(default_factory=AnonymousSpec)
    trusted_tenant_header: str | None = Field(
        None, max_length=128, pattern=r"^[A-Za-z0-9-]+$",
        description="Take the tenant from this header (only behind a trusted gateway).",
    )


class QuotaSplit(StrEnum):
    """How a tenant's pool-wide quota is divided over the pool's ready engines."""

    EVEN = "Even"
    DEMAND = "Demand"


class PoolStoreSpec(_Model):
    """A Redis or Valkey the pool's sidecars share for pool-wide admission."""

    address: str = Field(
        min_length=1, max_length=253, pattern=r"^[-.a-zA-Z0-9\[\]:]+:[0-9]{1,5}$",
        description="host:port of the store (the one Envoy's global rate limiting uses "
        "will do).",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        None, description="The store's password: a key of a Secret the engine pods mount "
        "in the sidecar's secrets directory (never logged).",
    )
    ttl_seconds: float = Field(
        10.0, ge=0.5, le=300, description="How long a sidecar's pool-wide charges outlive "
        "it: a sidecar that dies frees them within this.",
    )
    timeout_ms: float = Field(
        5.0, ge=0.1, le=1000, description="The most a request waits for the store; past it "
        "the engine keeps to what it had claimed of its split, never above the pool-wide "
        "maxBlocks.",
    )


class InferencePoolSpec(BaseModel):
    model_config = _rules(
        (
            "has(self.selector) != has(self.gatewayPoolRef)",
            "exactly one of selector or gatewayPoolRef must be set",
        )
    )
    selector: LabelSelector | None = Field(
        None, description="The engine pods (in this namespace) that serve the pool. Exactly "
        "one of selector and gatewayPoolRef is set.",
    )
    gateway_pool_ref: LocalObjectRef | None = Field(
        None, description="A Gateway API Inference Extension InferencePool in this namespace "
        "whose selector names the engine pods, instead of selector.",
    )
    model: str = Field(
        min_length=1, max_length=512,
        description="The model name clients send and /v1/models lists; the sidecar maps it "
        "to the engine's own model name.",
    )
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    tiers: TiersSpec = Field(default_factory=TiersSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    quota_split: QuotaSplit = Field(
        QuotaSplit.EVEN,
        description="How each tenant's pool-wide quota is divided over the ready engines. "
        "Even: the same share on every engine. Demand: every engine poll moves a tenant's "
        "per-engine guarantee toward the engines its traffic reaches (pool-wide totals "
        "kept, at most half an even share per engine per poll, never below what an "
        "engine's running work holds; shown in TenantQuota status.engines), for routers "
        "that keep a tenant's sessions on a few engines (prefix- or session-affine).",
    )
    pool_store: PoolStoreSpec | None = Field(
        None, description="A shared store (Redis or Valkey) for pool-wide admission: a "
        "request its engine's split would refuse is admitted if the tenant's pool-wide "
        "quota allows, checked and charged atomically on the store. Unset: each engine "
        "admits on its split alone.",
    )


class EngineCounts(_Model):
    """The pool's engine pods, as the operator last polled them."""

    ready: int = Field(0, description="Ready engine pods the pool's selector matches.")
    synced: int = Field(
        0, description="Ready engines whose sidecar runs the current policy (policyHash)."
    )


class InferencePoolStatus(_Model):
    observed_generation: int | None = Field(
        None, description="The metadata.generation this status was computed from."
    )
    conditions: Conditions = Field(
        description="Ready (engine pods found and ready), Synced (every ready engine runs "
        "the current policy), Oversubscribed (the TenantQuotas ask for more guaranteed "
        "blocks than the pool can guarantee)."
    )
    engines: EngineCounts = Field(default_factory=EngineCounts)
    capacity_blocks: int | None = Field(
        None, description="Pool-wide KV blocks: the per-engine capacity times the ready "
        "engines (at least 1). Unset until the capacity is known.",
    )
    guaranteed_blocks: int | None = Field(
        None, description="KV blocks guaranteed to accepted TenantQuotas, pool-wide."
    )
    used_blocks: int | None = Field(
        None, description="KV blocks in use, summed over the engines that answered the last "
        "poll (unset in local mode).",
    )
    leased_blocks: int | None = Field(
        None, description="KV blocks pinned by idle sessions' leases, summed over the "
        "engines that answered the last poll.",
    )
    tenants: int | None = Field(None, description="Tenants in the pool's current policy.")
    policy_hash: str | None = Field(
        None, max_length=128,
        description="Content hash of the policy the operator rendered for the pool; each "
        "engine's sidecar reports the hash it runs.",
    )


# ---------------------------------------------------------------- TenantQuota


class LeaseSpec(_Model):
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
    max_blocks: int | None = Field(
        None, ge=0, le=100_000_000,
        description="Distinct KV blocks the tenant's leases may pin, pool-wide (unset or 0: "
        "no cap).",
    )


class TenantKVCacheSpec(BaseModel):
    """The tenant's KV-cache quota in KV blocks, pool-wide. The operator splits it evenly
    over the pool's ready engines: guarantees rounded down, ceilings rounded up."""

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

    model_config = _rules(
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


class PrefixCacheSpec(_Model):
    """Whether the tenant's prompts share vLLM's prefix cache with other tenants."""

    isolation: Isolation = Field(
        Isolation.TENANT,
        description="Tenant: the sidecar gives the tenant's requests their own cache_salt, "
        "so no other tenant can probe its prompts by timing. Shared: no salt, cached "
        "prefixes are shared.",
    )


class TenantQuotaSpec(BaseModel):
    model_config = _rules(
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


class EffectiveSettings(_Model):
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
    lease_max_blocks: int | None = Field(
        None, description="KV blocks the leases may pin, pool-wide (0: no cap)."
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


class _WireView(_Model):
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


class EngineSplitStatus(_Model):
    """The tenant's blocks on one ready engine (even, or moved by the demand split)."""

    pod: str = Field(max_length=253, description="The engine pod.")
    guaranteed_blocks: int = Field(0, ge=0, description="Blocks guaranteed on this engine.")
    max_blocks: int = Field(0, ge=0, description="The tenant's ceiling on this engine.")


MAX_STATUS_ENGINES = 1024  # a longer pool lists its first engines by name


class TenantQuotaStatus(_Model):
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
    api_version: ApiVersion = API_VERSION
    kind: Literal["InferencePool"] = "InferencePool"
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None


class TenantQuota(_Model):
    api_version: ApiVersion = API_VERSION
    kind: Literal["TenantQuota"] = "TenantQuota"
    metadata: ObjectMeta
    spec: TenantQuotaSpec
    status: TenantQuotaStatus | None = None

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id or self.metadata.name
