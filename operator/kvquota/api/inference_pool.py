"""The InferencePool kind: a pool of vLLM engines, its KV cache, tiers, preemption,
authentication and pool-wide store (spec), and what the operator observes (status).

These models are the CRD's source of truth (`kvquota crds` generates it): defaults,
bounds and patterns come from the fields, CEL rules from `with_cel_rules(...)`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from engine_sidecar.contract.names import API_VERSION, ApiVersion
from engine_sidecar.contract.policy import (
    MAX_TOKEN_LIFETIME_SECONDS,
    TENANT_ID_PATTERN,
    JwtAlgorithm,
    default_algorithms,
)
from kvquota.api.conditions import Conditions
from kvquota.api.meta import (
    ApiModel,
    LabelSelector,
    LocalObjectRef,
    ObjectMeta,
    SecretKeyRef,
    ShortString,
    with_cel_rules,
)
from kvquota.api.tiers import TiersSpec

# vLLM's own config takes any positive --block-size; its attention kernels need a
# multiple of 16 (FlashAttention, Triton: MultipleOf(16)) or 32 (the CPU backend).
BLOCK_SIZE_MULTIPLE = 16


MAX_BLOCK_SIZE = 2048  # vLLM sets no maximum: this one catches a typo such as 16384


class KVCacheSpec(ApiModel):
    """The engines' KV cache as vLLM runs it, and the share kept free for borrowing."""

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
        # A rule on the field itself, so the API server quotes the value it refused.
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self >= 0.0 && self < 0.5",
             "message": "kvCache.watermark must be >= 0 and < 0.5"},
        ]},
    )


class PreemptionSpec(ApiModel):
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

    model_config = with_cel_rules(
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

    model_config = with_cel_rules(
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


class AuthSpec(ApiModel):
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


class PoolStoreSpec(ApiModel):
    """A Redis or Valkey the pool's sidecars share for pool-wide admission."""

    address: str = Field(
        min_length=1, max_length=253, pattern=r"^[-.a-zA-Z0-9\[\]:]+:[0-9]{1,5}$",
        description="host:port of the store (the one Envoy's global rate limiting uses "
        "will do).",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        None, description="The store's password: a key of its own Secret, which injection "
        "mounts in the sidecar (kvquota-pool-store unless `kvquota inject "
        "--pool-store-secret` names another; a key of the pool's auth Secret is read too). "
        "Never logged nor shown in any status.",
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
    model_config = with_cel_rules(
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


class EngineCounts(ApiModel):
    """The pool's engine pods, as the operator last polled them."""

    ready: int = Field(0, description="Ready engine pods the pool's selector matches.")
    synced: int = Field(
        0, description="Ready engines whose sidecar runs the current policy (policyHash)."
    )


class InferencePoolStatus(ApiModel):
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


class InferencePool(ApiModel):
    api_version: ApiVersion = API_VERSION
    kind: Literal["InferencePool"] = "InferencePool"
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None
