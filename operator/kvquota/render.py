"""Build the per-pool EnginePolicy and the ConfigMap that carries it to the engines.

Pure builders: the operator writes what these return, local mode writes the JSON to
a file, and tests assert on both without an API server.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from engine_sidecar.contract.names import (
    API_VERSION,
    GROUP,
    POLICY_CONFIGMAP_SUFFIX,
    POLICY_FILE,
    POOL_LABEL,
)
from engine_sidecar.contract.policy import (
    AnonymousPolicy,
    AuthPolicy,
    EnginePolicy,
    EngineShare,
    JwtPolicy,
    ReservationMode,
    TenantPolicy,
    Tier,
)
from kvquota.api import AuthSpec, InferencePoolSpec
from kvquota.policy_text import RenderedPolicy, RenderedTenant, compose, render_tenant
from kvquota.policy_text import tenant_digest as tenant_digest  # re-exported

HASH_ANNOTATION = f"{GROUP}/policy-hash"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvquota", "app.kubernetes.io/component": "policy"}
_MAX_NAME = 253


def configmap_name(pool_name: str) -> str:
    """`<pool>-kvquota-policy`; a pool name near the 253-character limit is shortened
    with a hash so two long names never collide."""
    name = pool_name + POLICY_CONFIGMAP_SUFFIX
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(pool_name.encode()).hexdigest()[:8]
    suffix = POLICY_CONFIGMAP_SUFFIX
    return f"{pool_name[: _MAX_NAME - len(suffix) - 9]}-{digest}{suffix}"


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
    )
    return compose(head, tenants, engines)


def render_reservation(spec: InferencePoolSpec) -> dict[Tier, ReservationMode]:
    """The tiers whose reservation the pool sets; the others reserve the default."""
    modes = {tier: getattr(spec.tiers, tier.value).reservation for tier in Tier}
    return {tier: mode for tier, mode in modes.items() if mode is not None}


def build_configmap(
    namespace: str, name: str, uid: str | None, policy: EnginePolicy | RenderedPolicy
) -> dict[str, Any]:
    """The ConfigMap owned by the pool (deleted with it by the garbage collector).
    A `RenderedPolicy` brings its JSON; an EnginePolicy is serialised here."""
    text = policy.text if isinstance(policy, RenderedPolicy) else policy.to_json()
    if isinstance(policy, RenderedPolicy):
        policy = policy.policy
    metadata: dict[str, Any] = {
        "name": configmap_name(name),
        "namespace": namespace,
        "labels": {**MANAGED_BY, POOL_LABEL: name},
        "annotations": {HASH_ANNOTATION: policy.version},
    }
    if uid:
        metadata["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": "InferencePool",
                "name": name,
                "uid": uid,
                "controller": True,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {POLICY_FILE: text + "\n"},
    }
