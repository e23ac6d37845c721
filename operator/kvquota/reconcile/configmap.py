"""The ConfigMap that carries a pool's policy to its engines.

Pure: the operator writes what `build_configmap` returns, tests assert on it without
an API server. The policy itself is assembled in `kvquota.policy.render`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine_sidecar.contract.names import (
    API_VERSION,
    GROUP,
    POLICY_CONFIGMAP_SUFFIX,
    POLICY_FILE,
    POOL_LABEL,
)
from engine_sidecar.contract.policy import EnginePolicy
from kvquota.policy.render import RenderedPolicy

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
