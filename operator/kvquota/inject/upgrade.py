"""Pods injected by an older release, brought to this release's names and sidecar image.

An injected pod template kept in Git names the plugin's class path, the pre-flight
module and the sidecar image of the release that injected it; injecting it again
leaves it alone (a pod injected twice stays the same). `kvquota inject --upgrade`
rewrites those names by `engine_sidecar.contract.renamed.RENAMED`, points the
KVQuota containers at this release's image, mounts what this release's sidecar reads
that the old one did not (the pool store password's own Secret, optional), writes the
`apiVersion` into the fieldRefs it injected (so re-applying does not conflict), and
changes nothing else the user wrote.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from engine_sidecar.contract.names import ENGINE_NAME_ENV
from engine_sidecar.contract.renamed import RENAMED, Renamed
from kvquota.inject.objects import TEMPLATE_KINDS, describe
from kvquota.inject.pod import (
    INIT,
    INJECTED_ANNOTATION,
    SECRETS_DIR,
    SIDECAR,
    STORE_SECRETS_DIR,
    STORE_VOLUME,
    InjectionOptions,
)

# An old name as a whole word of an argument: `--scheduler-cls=OLD`, `OLD`, or within a
# shell command line; never a prefix of a longer dotted name.
_PATTERNS = [(re.compile(rf"(?<![\w.]){re.escape(r.old)}(?![\w.])"), r) for r in RENAMED]


@dataclass
class Upgrade:
    """What the rewrite changed, worded for the user (one line each)."""

    obj: dict[str, Any]
    changes: list[str] = field(default_factory=list)


def _pod(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj.get("kind") == "Pod":
        return obj
    if obj.get("kind") in TEMPLATE_KINDS:
        template: dict[str, Any] | None = (obj.get("spec") or {}).get("template")
        return template
    return None


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def deprecated_names(obj: dict[str, Any]) -> list[Renamed]:
    """The renamed names an injected pod (or pod template) still carries."""
    pod = _pod(obj)
    if pod is None:
        return []
    found: dict[str, Renamed] = {}
    for container in _containers(pod.get("spec") or {}):
        for word in [*(container.get("command") or []), *(container.get("args") or [])]:
            for pattern, renamed in _PATTERNS:
                if isinstance(word, str) and pattern.search(word):
                    found[renamed.old] = renamed
    return list(found.values())


def upgrade_object(obj: dict[str, Any], image: str,
                   store_secret: str = InjectionOptions.store_secret) -> Upgrade:
    """`obj` (a copy) with its injected pod's renamed names replaced and KVQuota's
    containers on `image`; objects that are not injected pods come back unchanged."""
    pod = _pod(obj)
    spec = (pod or {}).get("spec") or {}
    if not any(c.get("name") == SIDECAR for c in spec.get("containers") or []):
        return Upgrade(obj)
    out = copy.deepcopy(obj)
    pod = _pod(out)
    assert pod is not None
    result = Upgrade(out)
    where = describe(obj)
    for container in _containers(pod["spec"]):
        for key in ("command", "args"):
            words = container.get(key) or []
            for i, word in enumerate(words):
                for pattern, renamed in _PATTERNS:
                    if isinstance(word, str) and pattern.search(word):
                        word = pattern.sub(renamed.new, word)
                        result.changes.append(f"{where}: container {container['name']!r}: "
                                              f"{renamed.old} -> {renamed.new}")
                words[i] = word
        if container.get("name") in (SIDECAR, INIT) and container.get("image") != image:
            result.changes.append(f"{where}: container {container['name']!r}: image "
                                  f"{container.get('image')} -> {image}")
            container["image"] = image
    _mount_store_secret(pod["spec"], store_secret, result, where)
    _fill_field_refs(pod["spec"], result, where)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if INJECTED_ANNOTATION in annotations:
        annotations[INJECTED_ANNOTATION] = image
    return result


def _fill_field_refs(spec: dict[str, Any], result: Upgrade, where: str) -> None:
    """Before 0.2.0 the fieldRefs injection wrote had no `apiVersion`; the API server
    fills in `v1` within an atomic struct, so a second field manager applying the
    manifest conflicted with the first. Only KVQuota's containers, and the engine-name
    variable injection adds to the others, are touched."""
    for container in _containers(spec):
        ours = container.get("name") in (SIDECAR, INIT)
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("fieldRef")
            if not isinstance(ref, dict) or "apiVersion" in ref:
                continue
            if ours or (var.get("name") == ENGINE_NAME_ENV
                        and ref.get("fieldPath") == "metadata.name"):
                var["valueFrom"]["fieldRef"] = {"apiVersion": "v1", **ref}
                result.changes.append(f"{where}: container {container['name']!r}: env "
                                      f"{var.get('name')}: fieldRef apiVersion v1")


def _mount_store_secret(spec: dict[str, Any], secret: str, result: Upgrade,
                        where: str) -> None:
    """Before 0.2.0 the sidecar read the store's password from the auth Secret only:
    mount its own Secret where `inject_pod` does, each beside the auth one."""
    (sidecar,) = [c for c in spec["containers"] if c.get("name") == SIDECAR]
    command = sidecar.get("command") or []
    if "--pool-store-secrets-dir" in command or "--secrets-dir" not in command:
        return
    at = command.index("--secrets-dir") + 2
    command[at:at] = ["--pool-store-secrets-dir", STORE_SECRETS_DIR]
    mounts = sidecar.setdefault("volumeMounts", [])
    at = next((i + 1 for i, m in enumerate(mounts) if m.get("mountPath") == SECRETS_DIR),
              len(mounts))
    mounts.insert(at, {"name": STORE_VOLUME, "mountPath": STORE_SECRETS_DIR,
                       "readOnly": True})
    volumes = spec.setdefault("volumes", [])
    at = next((i + 1 for i, v in enumerate(volumes) if v.get("name") == "kvquota-secrets"),
              len(volumes))
    volumes.insert(at, {"name": STORE_VOLUME, "secret": {
        "secretName": secret, "defaultMode": 0o444, "optional": True}})
    result.changes.append(f"{where}: container {SIDECAR!r}: mounts the pool store's "
                          f"password Secret {secret} (optional)")
