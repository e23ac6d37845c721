"""EnginePolicy: the per-pool policy the operator renders and every engine applies.

The engine side owns this schema; the operator imports it to render. All block and
concurrency limits here are *per engine replica* (the operator has already split the
pool-wide quotas across ready replicas). JSON field names are camelCase, like the CRDs.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel

from engine_sidecar.contract.names import API_VERSION, ApiVersion

TENANT_ID_PATTERN = r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$"
TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN, max_length=63)]


JwtAlgorithm = Literal[
    "HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256"
]


MAX_TOKEN_LIFETIME_SECONDS = 366 * 86_400


def default_algorithms() -> list[JwtAlgorithm]:
    return ["RS256"]


class Tier(StrEnum):
    PREMIUM = "premium"
    STANDARD = "standard"
    FREE = "free"


class Isolation(StrEnum):
    TENANT = "Tenant"
    SHARED = "Shared"


class ReservationMode(StrEnum):
    """What a request of a tier reserves at admission (`spec.tiers.<tier>.reservation`)."""

    # Prompt + the output its tenant's requests on that route usually produce (learned by
    # the sidecar, `gateway.output_estimate`); past it, it is charged what it holds.
    ESTIMATED = "Estimated"
    # Prompt + max_tokens: no admitted request ever grows past its reservation, so none is
    # preempted for growing (the no-eviction promise), at the price of KV held idle.
    FULL = "Full"


# A tier the policy does not name reserves this way (README: reservations).
DEFAULT_RESERVATION = ReservationMode.ESTIMATED


class AboveMax(StrEnum):
    """Whether a tenant at its maxBlocks may run more work into KV nobody else wants
    (`spec.kvCache.aboveMax`)."""

    # Into free blocks above the watermark while no other tenant's request waits for
    # capacity; that work is the first victim of the victim order (README: above maxBlocks).
    RECLAIMABLE = "Reclaimable"
    # maxBlocks is a hard ceiling (for tenants billed or capped by it).
    NEVER = "Never"


DEFAULT_ABOVE_MAX = AboveMax.RECLAIMABLE


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class LeasePolicy(_Model):
    seconds: int = Field(0, ge=0, le=86_400, description="Pin an idle session's KV this long.")
    max_sessions: int = Field(0, ge=0, description="Leased sessions per engine (0: no cap).")
    max_leased_blocks: int = Field(
        0, ge=0, alias="maxBlocks",
        description="Distinct KV blocks the tenant's leases may pin on this engine (0: no cap).",
    )


class PoolLimits(_Model):
    """A tenant's pool-wide quota, which the shared ledger (`EnginePolicy.poolStore`)
    holds every engine's charges to. Rendered only for pools that name a store."""

    guaranteed_blocks: int = Field(ge=0)
    max_blocks: int = Field(ge=0, description="The tenant's ceiling, pool-wide.")
    max_concurrent_requests: int | None = Field(None, ge=1)


class PoolStorePolicy(_Model):
    """The pool-wide ledger's store (Redis or Valkey); its password is a file in the
    sidecar's mounted secrets directory, never in the policy."""

    address: str = Field(min_length=1, max_length=253, pattern=r"^[-.a-zA-Z0-9\[\]:]+$",
                         description="host:port of the store.")
    password_file: str | None = Field(None, min_length=1, max_length=253,
                                      pattern=r"^[-._a-zA-Z0-9]+$")
    ttl_seconds: float = Field(10.0, ge=0.5, le=300, description="How long a sidecar's "
                               "charges outlive its last refresh (it refreshes 3x per TTL).")
    timeout_ms: float = Field(5.0, ge=0.1, le=1000, description="The bounded wait for the "
                              "store; past it admission keeps to what it had claimed.")


class TenantPolicy(_Model):
    tenant_id: TenantId
    tier: Tier
    priority: int = Field(ge=0, le=2, description="vLLM priority; lower runs first.")
    guaranteed_blocks: int = Field(ge=0)
    max_blocks_per_engine: int = Field(
        ge=0, alias="maxBlocks",
        description="Blocks the tenant may hold on this engine (its share of the pool-wide "
        "maxBlocks); beyond it only as `above_max` allows.",
    )
    above_max: AboveMax = DEFAULT_ABOVE_MAX
    lease: LeasePolicy = LeasePolicy()
    max_tokens: int = Field(ge=1, description="Ceiling that max_tokens is clamped to.")
    default_max_tokens: int = Field(ge=1, description="max_tokens when the client sends none.")
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_concurrent_requests: int | None = Field(None, ge=1)
    max_queue_seconds: float = Field(
        30.0, ge=0, le=3600, description="A request that cannot be admitted waits at most "
        "this long in the sidecar's queue before it is refused (0: refused at once)."
    )
    max_queued_requests: int = Field(
        256, ge=0, description="Requests of the tenant that may wait at once per engine."
    )
    prefix_cache_isolation: Isolation = Isolation.TENANT
    pool_wide: PoolLimits | None = Field(
        None, description="The pool-wide quota, when the pool has a shared ledger; left "
        "out of the JSON otherwise."
    )

    @model_serializer(mode="wrap")
    def _omit_no_pool_wide(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.pool_wide is None:
            data.pop("poolWide", None)
            data.pop("pool_wide", None)
        return data

    @model_validator(mode="after")
    def _check_bounds(self) -> TenantPolicy:
        if self.max_blocks_per_engine < self.guaranteed_blocks:
            raise ValueError(
                f"tenant {self.tenant_id}: maxBlocks ({self.max_blocks_per_engine}) must be >= "
                f"guaranteedBlocks ({self.guaranteed_blocks})"
            )
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"tenant {self.tenant_id}: defaultMaxTokens ({self.default_max_tokens}) "
                f"must be <= maxTokens ({self.max_tokens})"
            )
        return self

    @property
    def ceiling(self) -> int | None:
        """Usage beyond which the tenant's work is reclaimable above-max work (None: it
        runs none; maxBlocks is a hard ceiling)."""
        return self.max_blocks_per_engine if self.above_max is AboveMax.RECLAIMABLE else None


class EngineShare(_Model):
    """A tenant's blocks on one engine when they differ from the even split."""

    guaranteed_blocks: int = Field(ge=0)
    max_blocks_per_engine: int = Field(ge=0, alias="maxBlocks",
                                       description="The tenant's ceiling on this engine.")

    @model_validator(mode="after")
    def _check_bounds(self) -> EngineShare:
        if self.max_blocks_per_engine < self.guaranteed_blocks:
            raise ValueError(f"maxBlocks ({self.max_blocks_per_engine}) must be >= "
                             f"guaranteedBlocks ({self.guaranteed_blocks})")
        return self


class JwtPolicy(_Model):
    """Where the sidecar finds the verification key: `keyFile` names a file inside the
    mounted Secret directory (the Secret itself never enters the policy)."""

    key_file: str = Field(min_length=1, max_length=253)
    algorithms: list[JwtAlgorithm] = Field(
        default_factory=default_algorithms, min_length=1, max_length=8
    )
    issuer: str | None = Field(None, max_length=512)
    audience: str | None = Field(None, max_length=512)
    tenant_claim: str = Field("tenant_id", min_length=1, max_length=128)
    leeway_seconds: int = Field(30, ge=0, le=300)
    max_token_lifetime_seconds: int | None = Field(
        None, ge=1, le=MAX_TOKEN_LIFETIME_SECONDS,
        description="Refuse tokens that expire further ahead than this, or whose exp - iat "
        "is larger (None: no limit).",
    )

    @model_validator(mode="after")
    def _one_key_family(self) -> JwtPolicy:
        families = {alg[:2] for alg in self.algorithms}
        if "HS" in families and len(families) > 1:
            raise ValueError("jwt.algorithms: do not mix HMAC (HS*) with public-key algorithms")
        return self


class AnonymousPolicy(_Model):
    allowed: bool = False
    tenant_id: TenantId | None = None

    @model_validator(mode="after")
    def _tenant_when_allowed(self) -> AnonymousPolicy:
        if self.allowed and not self.tenant_id:
            raise ValueError("auth.anonymous.tenantId is required when anonymous is allowed")
        return self


class AuthPolicy(_Model):
    jwt: JwtPolicy | None = None
    anonymous: AnonymousPolicy = AnonymousPolicy()
    trusted_tenant_header: str | None = Field(None, max_length=128)


class EnginePolicy(_Model):
    api_version: ApiVersion = API_VERSION
    kind: Literal["EnginePolicy"] = "EnginePolicy"
    pool: str = Field(min_length=1, max_length=253, description="namespace/name of the pool")
    model: str = Field(min_length=1, max_length=512)
    block_size: int = Field(16, ge=1, le=1024)
    capacity_blocks: int | None = Field(
        None, ge=1, description="Per-engine KV capacity override; else the engine's own."
    )
    watermark: float = Field(0.15, ge=0.0, lt=0.5)
    recompute_below_blocks: int = Field(128, ge=0)
    replicas: int = Field(1, ge=1, description="Ready replicas the quotas were split over.")
    auth: AuthPolicy = AuthPolicy()
    reservation: dict[Tier, ReservationMode] = Field(
        default_factory=dict,
        description="Tier -> what its requests reserve at admission; a tier absent here "
        "reserves DEFAULT_RESERVATION. Left out of the JSON when empty.",
    )
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    engines: dict[str, dict[str, EngineShare]] = Field(
        default_factory=dict, max_length=4096,
        description="The demand-driven split: engine pod name -> tenant id -> its "
        "blocks there. A tenant absent for an engine has its `tenants` entry's blocks "
        "there (the even split). Left out of the JSON when empty, so a policy without "
        "overrides reads as before.",
    )
    pool_store: PoolStorePolicy | None = Field(
        None, description="The pool-wide ledger's store; none: each engine admits on its "
        "own split of the quotas. Left out of the JSON when unset."
    )
    version: str = Field("", description="Content hash; set by with_version().")

    @model_validator(mode="after")
    def _keys_match_ids(self) -> EnginePolicy:
        for key, tenant in self.tenants.items():
            if key != tenant.tenant_id:
                raise ValueError(f"tenants[{key!r}] holds tenantId {tenant.tenant_id!r}")
        for engine, shares in self.engines.items():
            unknown = sorted(set(shares) - set(self.tenants))
            if unknown:
                raise ValueError(f"engines[{engine!r}] names tenants not in the policy: "
                                 f"{', '.join(unknown[:5])}")
        return self

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The canonical form: fields added after v1alpha1's first release are left out
        while unused. The version is the hash of this form and every sidecar checks it
        (`from_json`), so emitting them would make each policy an earlier operator wrote
        fail that check (tests/upgrade/test_policy_upgrade.py)."""
        data: dict[str, Any] = handler(self)
        if not self.engines:
            data.pop("engines", None)
        if not self.reservation:
            data.pop("reservation", None)
        if self.pool_store is None:
            data.pop("poolStore", None)
            data.pop("pool_store", None)
        return data

    def reservation_for(self, tier: Tier) -> ReservationMode:
        """How requests of `tier` reserve KV at admission."""
        return self.reservation.get(tier, DEFAULT_RESERVATION)

    def for_engine(self, engine: str | None) -> EnginePolicy:
        """What the engine named `engine` (its pod name; None: unnamed) enforces: each
        tenant's blocks from its `engines` entry where there is one, else the even
        split. Same version: it is the same policy, read by one engine."""
        shares = self.engines.get(engine) if engine else None
        if not shares:
            return self
        tenants = dict(self.tenants)
        for tenant_id, share in shares.items():
            tenants[tenant_id] = tenants[tenant_id].model_copy(update={
                "guaranteed_blocks": share.guaranteed_blocks,
                "max_blocks_per_engine": share.max_blocks_per_engine})
        return self.model_copy(update={"tenants": tenants})

    def blocks_on(self, engine: str, tenant_id: str) -> tuple[int, int]:
        """(guaranteed, maximum) of one tenant on the engine named `engine`, as
        `for_engine(engine)` gives them, without copying the policy."""
        share = self.engines.get(engine, {}).get(tenant_id)
        if share is not None:
            return share.guaranteed_blocks, share.max_blocks_per_engine
        even = self.tenants[tenant_id]
        return even.guaranteed_blocks, even.max_blocks_per_engine

    def content_hash(self) -> str:
        body = self.model_dump(mode="json", by_alias=True, exclude={"version"})
        return version_of(json.dumps(body, sort_keys=True, separators=(",", ":")))

    def with_version(self) -> EnginePolicy:
        return self.model_copy(update={"version": self.content_hash()})

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def from_json(cls, raw: str | bytes) -> EnginePolicy:
        """Parse and check the version: a policy whose hash does not match is refused."""
        policy = cls.model_validate_json(raw)
        if policy.version and policy.version != policy.content_hash():
            raise ValueError(
                f"policy version {policy.version} does not match its content "
                f"({policy.content_hash()})"
            )
        return policy

    def tenant(self, tenant_id: str | None) -> TenantPolicy | None:
        return self.tenants.get(tenant_id) if tenant_id else None


def version_of(canonical: str) -> str:
    """A policy's version from its canonical JSON (sorted keys, no spaces, no version)."""
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
