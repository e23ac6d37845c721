"""Builders for InferencePool / TenantQuota objects as a user would write them."""

from __future__ import annotations

from typing import Any

API_VERSION = "kvquota.dev/v1alpha1"
SELECTOR = {"matchLabels": {"app": "vllm", "kvquota.dev/pool": "demo-pool"}}


def pool(
    name: str = "demo-pool",
    namespace: str = "default",
    *,
    capacity: int | None = 1000,
    watermark: float = 0.15,
    **spec: Any,
) -> dict[str, Any]:
    kv_cache: dict[str, Any] = {"blockSize": 16, "watermark": watermark}
    if capacity is not None:
        kv_cache["capacityBlocks"] = capacity
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"selector": SELECTOR, "model": "tiny", "kvCache": kv_cache, **spec},
    }


def quota(
    name: str,
    *,
    pool: str = "demo-pool",
    namespace: str = "default",
    tier: str = "standard",
    guaranteed: int = 0,
    maximum: int = 100,
    created: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if created:
        meta["creationTimestamp"] = created
    kv_cache = {"guaranteedBlocks": guaranteed, "maxBlocks": maximum, **spec.pop("kvCache", {})}
    return {
        "apiVersion": API_VERSION,
        "kind": "TenantQuota",
        "metadata": meta,
        "spec": {"poolRef": {"name": pool}, "tier": tier, "kvCache": kv_cache, **spec},
    }


def condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for item in (status or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    raise AssertionError(f"no {type_} condition in {status}")
