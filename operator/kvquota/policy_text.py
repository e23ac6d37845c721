"""A pool's EnginePolicy assembled from per-tenant pieces serialised once.

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

from engine_sidecar.contract.policy import EnginePolicy, EngineShare, TenantPolicy, version_of

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
