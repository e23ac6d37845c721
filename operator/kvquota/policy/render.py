"""A pool's EnginePolicy, assembled from its spec and per-tenant pieces serialised once.

Pure: the operator puts what `compose_policy` returns in the pool's ConfigMap
(`kvquota.reconcile.configmap`), local mode writes its JSON to a file, and tests assert on both.

Hashing and serialising a policy of 1,000 tenants whole costs tens of milliseconds,
and an edit changes one tenant. Each tenant's entry is serialised once, when it
changes (`render_tenant`), in the two forms a policy needs: the canonical JSON its
version hashes (`EnginePolicy.content_hash`: sorted keys, no spaces) and the indented
JSON the ConfigMap carries (`EnginePolicy.to_json`). `compose` then joins the pieces:
the same version and the same text, character for character, as the whole policy
would give (tests compare both), for the cost of a string join.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from engine_sidecar.contract.policy import (
    AnonymousPolicy,
    AuthPolicy,
    EnginePolicy,
    EngineShare,
    JwtPolicy,
    PoolStorePolicy,
    ReservationMode,
    TenantPolicy,
    Tier,
    version_of,
)
from kvquota.api import AuthSpec, InferencePoolSpec

_CANONICAL: dict[str, Any] = {"sort_keys": True, "separators": (",", ":")}
_ENTRIES = TypeAdapter(dict[str, TenantPolicy])
_EMPTY_TENANTS = '\n  "tenants": {}'  # how to_json writes the field of a policy without tenants
_NEST = "  "  # to_json's indent: an entry of `tenants` sits one level below the top


@dataclass(frozen=True)
class RenderedTenant:
    """One tenant's policy entry and its serialised forms."""

    policy: TenantPolicy
    canonical: str  # `"id":{...}` as in the policy's canonical JSON
    indented: str  # `    "id": {...}` as in the policy's to_json(), without a separator
    digest: str  # `tenant_digest` of the entry


@dataclass(frozen=True)
class RenderedPolicy:
    policy: EnginePolicy  # versioned
    text: str  # policy.to_json()


def tenant_digest(tenant: TenantPolicy) -> str:
    """Identifies one tenant's rendered settings across policy versions."""
    raw = tenant.model_dump_json(by_alias=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def render_tenant(policy: TenantPolicy) -> RenderedTenant:
    tenant_id = policy.tenant_id
    canonical = json.dumps({tenant_id: policy.model_dump(mode="json", by_alias=True)},
                           **_CANONICAL)[1:-1]
    alone = _ENTRIES.dump_json({tenant_id: policy}, by_alias=True, indent=2).decode()
    lines = alone.split("\n")[1:-1]  # the entry, without the braces around it
    indented = "\n".join(_NEST + line for line in lines)
    return RenderedTenant(policy, canonical, indented, tenant_digest(policy))


def compose(
    head: EnginePolicy, tenants: Iterable[RenderedTenant],
    engines: Mapping[str, Mapping[str, EngineShare]] | None = None,
) -> RenderedPolicy:
    """`head` (a policy's settings; its tenants, engines and version are ignored) with
    `tenants` sorted by tenant id (the last one of an id counts) and the per-engine
    overrides `engines` (pod -> tenant id -> share; sorted, empty ones dropped: they
    are few, so they are serialised whole), versioned."""
    by_id = {t.policy.tenant_id: t for t in tenants}
    entries = [by_id[tenant_id] for tenant_id in sorted(by_id)]
    overrides = {pod: {tid: shares[tid] for tid in sorted(shares)}
                 for pod, shares in sorted((engines or {}).items()) if shares}
    unknown = sorted({tid for shares in overrides.values() for tid in shares} - set(by_id))
    if unknown:
        raise ValueError(f"per-engine overrides for tenants not in the policy: {unknown[:5]}")
    head = head.model_copy(update={"engines": overrides})
    body = head.model_dump(mode="json", by_alias=True, exclude={"version", "tenants"})
    body["tenants"] = None  # a placeholder, for its place among the sorted keys
    canonical_tenants = "{" + ",".join(t.canonical for t in entries) + "}"
    canonical = "{" + ",".join(
        json.dumps(key) + ":" + (canonical_tenants if key == "tenants"
                                 else json.dumps(value, **_CANONICAL))
        for key, value in sorted(body.items())) + "}"
    policy = head.model_copy(update={
        "tenants": {t.policy.tenant_id: t.policy for t in entries},
        "version": version_of(canonical),
    })
    text = policy.model_copy(update={"tenants": {}}).to_json()
    if entries:
        if text.count(_EMPTY_TENANTS) != 1:
            raise RuntimeError("EnginePolicy.to_json() no longer writes `tenants` as expected")
        text = text.replace(_EMPTY_TENANTS, '\n  "tenants": {\n'
                            + ",\n".join(t.indented for t in entries) + "\n  }")
    return RenderedPolicy(policy, text)


def render_auth(auth: AuthSpec) -> AuthPolicy:
    jwt = None
    if auth.jwt is not None:
        jwt = JwtPolicy(
            key_file=auth.jwt.secret_ref.key,
            algorithms=list(auth.jwt.algorithms),
            issuer=auth.jwt.issuer,
            audience=auth.jwt.audience,
            tenant_claim=auth.jwt.tenant_claim,
            max_token_lifetime_seconds=auth.jwt.max_token_lifetime_seconds,
        )
    return AuthPolicy(
        jwt=jwt,
        anonymous=AnonymousPolicy(
            allowed=auth.anonymous.allowed, tenant_id=auth.anonymous.tenant_id
        ),
        trusted_tenant_header=auth.trusted_tenant_header,
    )


def render_policy(
    namespace: str,
    name: str,
    spec: InferencePoolSpec,
    tenants: Iterable[TenantPolicy],
    *,
    replicas: int,
) -> EnginePolicy:
    """The versioned policy every engine of the pool applies (tenants sorted by id,
    so equal content always serialises to equal JSON)."""
    return compose_policy(namespace, name, spec, map(render_tenant, tenants),
                          replicas=replicas).policy


def compose_policy(
    namespace: str,
    name: str,
    spec: InferencePoolSpec,
    tenants: Iterable[RenderedTenant],
    *,
    replicas: int,
    engines: Mapping[str, Mapping[str, EngineShare]] | None = None,
) -> RenderedPolicy:
    """`render_policy` from tenants already serialised (`render_tenant`, kept while
    they do not change), with the policy's JSON; `engines`: the per-engine overrides
    of the demand-driven split (`EnginePolicy.engines`)."""
    head = EnginePolicy(
        pool=f"{namespace}/{name}",
        model=spec.model,
        block_size=spec.kv_cache.block_size,
        capacity_blocks=spec.kv_cache.capacity_blocks,
        watermark=spec.kv_cache.watermark,
        recompute_below_blocks=spec.preemption.recompute_below_blocks,
        replicas=max(replicas, 1),
        auth=render_auth(spec.auth),
        reservation=render_reservation(spec),
        pool_store=render_pool_store(spec),
    )
    return compose(head, tenants, engines)


def render_pool_store(spec: InferencePoolSpec) -> PoolStorePolicy | None:
    """The store's address and where its password is mounted (the Secret's key)."""
    store = spec.pool_store
    if store is None:
        return None
    secret = store.password_secret_ref
    return PoolStorePolicy(address=store.address,
                           password_file=secret.key if secret is not None else None,
                           ttl_seconds=store.ttl_seconds, timeout_ms=store.timeout_ms)


def render_reservation(spec: InferencePoolSpec) -> dict[Tier, ReservationMode]:
    """The tiers whose reservation the pool sets; the others reserve the default."""
    modes = {tier: getattr(spec.tiers, tier.value).reservation for tier in Tier}
    return {tier: mode for tier, mode in modes.items() if mode is not None}
