"""The CRDs are generated from the models and carry the API conventions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvquota.api.crd import KINDS, build_crd, crd_path, write_or_check
from kvquota.cli import main

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_committed_crds_match_the_models() -> None:
    assert main(["crds", "--check", "--out", str(CRDS)]) == 0, (
        "models changed: run `kvquota crds` and commit")


def test_check_reports_drift_after_a_hand_edit(tmp_path: Path, capsys: Any) -> None:
    write_or_check(tmp_path, check=False)
    path = crd_path(tmp_path, "TenantQuota")
    path.write_text(path.read_text().replace("maxBlocks must be", "maxBlocks should be"))
    assert main(["crds", "--check", "--out", str(tmp_path)]) == 1
    assert "maxBlocks must be >= guaranteedBlocks" in capsys.readouterr().out


@pytest.mark.parametrize("kind", list(KINDS))
def test_crd_shape(kind: str) -> None:
    crd = yaml.safe_load(crd_path(CRDS, kind).read_text())
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{KINDS[kind]['plural']}.kvquota.dev"
    assert spec["group"] == "kvquota.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["kvquota"]
    assert spec["names"]["shortNames"] == {"InferencePool": ["kvpool"], "TenantQuota": ["tq"]}[kind]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert columns == {
        "InferencePool": ["Model", "Engines", "Capacity", "Used", "Ready", "Age"],
        "TenantQuota": ["Pool", "Tier", "Guaranteed", "Max", "Used", "Quota", "Ready", "Age"],
    }[kind]
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"
    ]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert conditions["maxItems"] <= 16
    item = conditions["items"]
    assert set(item["required"]) >= {"type", "status", "lastTransitionTime", "reason"}
    assert "pattern" in item["properties"]["reason"]


def _nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node under `node` (itself included) with its path, as kubectl
    explain walks them: properties, list items ([]) and map values ({})."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def _unbounded(node: dict[str, Any], path: str) -> list[str]:
    """Strings without a length/enum bound and lists without maxItems blow the CEL budget."""
    return [
        where for where, sub in _nodes(node, path)
        if (sub.get("type") == "string" and not ({"maxLength", "enum", "format"} & sub.keys()))
        or (sub.get("type") == "array" and "maxItems" not in sub)
    ]


@pytest.mark.parametrize("kind", list(KINDS))
def test_spec_strings_and_lists_are_bounded(kind: str) -> None:
    schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _unbounded(schema["properties"]["spec"], "spec") == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_field_explains_itself(kind: str) -> None:
    """`kubectl explain` on any path of either kind prints a description (for metadata,
    the API server's own: the root metadata may declare nothing but its type)."""
    schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    undocumented = [path for path, node in _nodes(schema, kind.lower())
                    if not node.get("description", "").strip()
                    and path != f"{kind.lower()}.metadata"]
    assert undocumented == [], f"schema nodes without a description: {undocumented}"


def test_nested_defaults_are_declared_for_kubectl_apply() -> None:
    schema = build_crd("InferencePool")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kv = schema["properties"]["spec"]["properties"]["kvCache"]
    assert kv["default"] == {"blockSize": 16, "watermark": 0.15}
    assert kv["properties"]["blockSize"]["default"] == 16
    assert kv["properties"]["watermark"]["default"] == 0.15
