"""Pods as kvquota 0.1.0 injected them, kept in Git by a team, met by this release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

OLD = Path(__file__).parent / "fixtures" / "0.1.0"
# What 0.1.0 was given: the injection tests' real-world specs, of the same names.
ORIGINAL = Path(__file__).parents[1] / "injection" / "fixtures"
NAMES = sorted(p.name for p in OLD.glob("*.yaml"))


def load_old(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((OLD / name).read_text())
    return obj


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
    return spec


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod_spec(obj)
    (found,) = [c for c in [*spec.get("initContainers", []), *spec["containers"]]
                if c["name"] == name]
    return found
