"""Write a pool's rendered policy to its ConfigMap, only when the ConfigMap does not
hold it already.

The hot path trusts what was last written (no read of a large object per quota edit);
an engine poll and the first sight of a pool read the ConfigMap, since someone may
have edited or deleted it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.names import POLICY_FILE
from engine_sidecar.contract.policy import EnginePolicy
from kvquota import metrics
from kvquota.reconcile.configmap import HASH_ANNOTATION, build_configmap, configmap_name
from kvquota.reconcile.status_writer import post_event

if TYPE_CHECKING:
    from kvquota.policy.render import RenderedPolicy
    from kvquota.reconcile.kube import KubeApi
    from kvquota.reconcile.sync import PolicyHistory

logger = logging.getLogger(__name__)


async def publish_policy(
    kube: KubeApi, pool: Mapping[str, Any], rendered: RenderedPolicy, *,
    known: str | None, history: PolicyHistory, verify: bool,
) -> str:
    """Make the pool's ConfigMap hold `rendered`; `known` is the hash we believe it
    holds (None: unknown, read it). Returns the hash it holds now."""
    meta: Mapping[str, Any] = pool.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    cm_name = configmap_name(name)
    policy = rendered.policy
    if known == policy.version and not verify:
        return known
    desired = build_configmap(namespace, name, meta.get("uid"), rendered)
    patch = {
        "metadata": {k: desired["metadata"][k] for k in
                     ("labels", "annotations", "ownerReferences")
                     if k in desired["metadata"]},
        "data": desired["data"],
    }
    if verify or known is None:
        current = await kube.get_configmap(namespace, cm_name)
        if current is None:
            await kube.create_configmap(desired)
        else:
            _remember_running(history, current)
            if _holds(current, desired):
                return policy.version
            await kube.patch_configmap(namespace, cm_name, patch)
    elif not await kube.patch_configmap(namespace, cm_name, patch):
        await kube.create_configmap(desired)  # deleted since we last wrote it
    metrics.POLICY_WRITES.inc()
    logger.info("pool %s/%s: policy %s written to ConfigMap %s (%d tenants)",
                namespace, name, policy.version, cm_name, len(policy.tenants))
    post_event(pool, "Normal", "PolicyUpdated",
               f"policy {policy.version} ({len(policy.tenants)} tenants, split over "
               f"{policy.replicas} replicas) written to ConfigMap {cm_name}")
    return policy.version


def _holds(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """The ConfigMap already carries exactly the desired policy and owner."""
    meta = current.get("metadata") or {}
    return bool(
        (meta.get("annotations") or {}).get(HASH_ANNOTATION)
        == desired["metadata"]["annotations"][HASH_ANNOTATION]
        and (current.get("data") or {}).get(POLICY_FILE) == desired["data"][POLICY_FILE]
        and meta.get("ownerReferences") == desired["metadata"].get("ownerReferences")
    )


def _remember_running(history: PolicyHistory, current: Mapping[str, Any]) -> None:
    """After a restart, engines still run the ConfigMap's previous policy: learn which
    tenant settings it carries, so unchanged tenants stay Ready."""
    version = ((current.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
    if not version or history.carries_version(version):
        return
    try:
        history.record(EnginePolicy.from_json((current.get("data") or {}).get(POLICY_FILE, "")))
    except ValueError:
        logger.warning("ConfigMap of pool %s holds an unreadable policy", version)
