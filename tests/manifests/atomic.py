"""Fields the API server fills in inside atomic structs, which a manifest must spell out.

Under server-side apply an atomic struct (`+structType=atomic` in k8s.io/api) is owned
whole by the manager that applied it. When the server then defaults a field inside it,
the stored struct differs from the manifest, and a second manager applying the same
manifest without `--force-conflicts` (Flux, a CI job, a person with a different
kubectl field manager) gets `conflict with "kubectl": ...valueFrom.fieldRef`. Writing
the default in the manifest makes both managers apply the stored value.

The same holds for the items of an atomic list (`+listType=atomic`): the list is owned
whole, so a default inside one item makes it differ.

Source: k8s.io/api/core/v1/types.go (`ObjectFieldSelector` and `ResourceFieldSelector`
are `+structType=atomic`) and pkg/apis/core/v1/defaults.go (`apiVersion: v1`); a
`resourceFieldRef` is stored with `divisor: "0"` when none is given.
k8s.io/api/networking/v1 (`NetworkPolicyIngressRule.ports`, `...EgressRule.ports`:
atomic lists; `protocol` defaults to TCP) and k8s.io/api/admissionregistration/v1
(`rules`: an atomic list; `scope` defaults to "*"). Issue #45, finding 5, is the
conflict a real kube-apiserver reported for `POD_ID`'s fieldRef.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# atomic struct (by its field name) -> the fields the API server fills in when absent
SERVER_FILLED = {
    "fieldRef": ("apiVersion",),
    "resourceFieldRef": ("divisor",),
}
# atomic list (a pattern of its path) -> the fields the API server fills in its items
SERVER_FILLED_IN_ITEMS = {
    re.compile(r"\.spec\.(ingress|egress)\[[^]]+\]\.ports$"): ("protocol",),
    re.compile(r"^\.webhooks\[[^]]+\]\.rules$"): ("scope",),
}


def _walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            name = item.get("name") if isinstance(item, dict) else None
            yield from _walk(item, f"{path}[{name or i}]")


def unfilled_atomic_fields(obj: dict[str, Any]) -> list[str]:
    """Where `obj` leaves a field of an atomic struct for the API server to fill in,
    as `Kind/name: path lacks field`."""
    where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    found = []
    for path, value in _walk(obj, ""):
        struct = path.rsplit(".", 1)[-1]
        if struct in SERVER_FILLED and isinstance(value, dict):
            found += [f"{where}: {path} lacks {field}"
                      for field in SERVER_FILLED[struct] if field not in value]
        for pattern, fields in SERVER_FILLED_IN_ITEMS.items():
            if pattern.search(path) and isinstance(value, list):
                found += [f"{where}: {path}[{i}] lacks {field}"
                          for i, item in enumerate(value) for field in fields
                          if isinstance(item, dict) and field not in item]
    return found
