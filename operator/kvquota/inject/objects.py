"""Injection of whole objects: a Pod, or the pod template of a workload."""

from __future__ import annotations

import copy
from typing import Any

from kvquota.inject.pod import POOL_LABEL, InjectionOptions, InjectionRefused, inject_pod

# Kinds whose pods come from `spec.template` (what `kvquota inject` accepts).
TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})


def describe(obj: dict[str, Any], namespace: str | None = None) -> str:
    """`Kind namespace/name` as a user would look it up (a ReplicaSet's pods have only
    a generateName at admission)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName")
                                else "(unnamed)")
    ns = meta.get("namespace") or namespace
    return f"{obj.get('kind', 'object')} {ns + '/' if ns else ''}{name}"


def inject_object(
    obj: dict[str, Any], pool: str | None = None, options: InjectionOptions | None = None,
    *, namespace: str | None = None, served_model_name: str | None = None,
) -> dict[str, Any]:
    """The object with its pod injected (a copy); objects of other kinds unchanged.
    `served_model_name`: the pool's `spec.model` (`inject_pod`).

    Raises InjectionRefused with the object named in the message.
    """
    kind = obj.get("kind")
    if kind == "Pod":
        holder, path = obj, ("metadata", "spec")
    elif kind in TEMPLATE_KINDS:
        holder, path = (obj.get("spec") or {}).get("template") or {}, ("metadata", "spec")
    else:
        return obj
    metadata = holder.get(path[0]) or {}
    if pool is None and POOL_LABEL not in (metadata.get("labels") or {}) and kind != "Pod":
        return obj  # a workload not labelled for a pool: left alone, as the webhook would
    try:
        injected = inject_pod(metadata, holder.get(path[1]) or {}, pool, options,
                              served_model_name)
    except InjectionRefused as exc:
        raise InjectionRefused(f"cannot inject {describe(obj, namespace)}: {exc}") from None
    if not injected.changed:
        return obj
    out = copy.deepcopy(obj)
    target = out if kind == "Pod" else out["spec"]["template"]
    meta = target.setdefault("metadata", {})
    meta["labels"] = injected.labels
    meta["annotations"] = injected.annotations
    target["spec"] = injected.spec
    if kind != "Pod":
        # The workload too, so the engine-sidecar component's selectors and the
        # PodMonitor find it the same way.
        labels = out.setdefault("metadata", {}).setdefault("labels", {})
        labels[POOL_LABEL] = injected.labels[POOL_LABEL]
    return out
