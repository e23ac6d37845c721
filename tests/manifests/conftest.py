"""Build the kustomizations under manifests/ once per session with `kubectl kustomize`."""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
KUBECTL = shutil.which("kubectl")


def kustomizations() -> list[Path]:
    """Every buildable kustomization (components only build inside one)."""
    found = []
    for path in sorted(MANIFESTS.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent)
    return found


@cache
def _build(directory: Path) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(directory)],
        capture_output=True, text=True, timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{out.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def build(directory: str | Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k <directory>` would send (directory relative to the repo)."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the manifests cannot be built with kustomize")
    return copy.deepcopy(list(_build((REPO / directory).resolve())))


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        o for o in objects
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
    return matches[0]
