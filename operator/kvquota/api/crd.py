"""`kvquota crds`: generate the CustomResourceDefinitions from the pydantic API models.

The models in `kvquota.api` are the single source of truth; `crds/` is generated and
`kvquota crds --check` (run by the tests) fails when it drifts. Both write and check
`./crds` by default (run them from the repository root) or `--out DIR`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema

from engine_sidecar.contract.names import GROUP, VERSION
from engine_sidecar.contract.policy import TENANT_ID_PATTERN
from kvquota.api import (
    ConditionType,
    InferencePoolSpec,
    InferencePoolStatus,
    TenantQuotaSpec,
    TenantQuotaStatus,
)

DEFAULT_OUT = Path("crds")  # relative: run from the repository root, or pass --out
_DROP_KEYS = {"title", "additionalProperties"}  # additionalProperties re-added for maps
_KEEP_KEYS = {
    "type", "description", "properties", "required", "items", "enum", "default",
    "format", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems",
    "maxItems", "maxProperties", "multipleOf", "nullable",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields",
}


def _column(name: str, path: str, type_: str = "string", priority: int = 0) -> dict[str, Any]:
    col: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path}
    if priority:
        col["priority"] = priority
    return col


def _condition(type_: ConditionType, priority: int = 0) -> dict[str, Any]:
    """A column showing the status of one condition."""
    return _column(str(type_), f'.status.conditions[?(@.type=="{type_}")].status',
                   priority=priority)


_AGE = _column("Age", ".metadata.creationTimestamp", "date")


def _columns(
    own: list[dict[str, Any]], *, beside_ready: ConditionType, leased: str,
    wide: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Both kinds' `kubectl get` columns: their own figures, Ready and Age; with `-o
    wide` also the condition that must be True beside Ready, the leased blocks, and
    `wide`."""
    return [
        *own, _condition(ConditionType.READY), _AGE,
        _condition(beside_ready, priority=1),
        _column("Leased", leased, "integer", priority=1),
        *wide,
    ]

KINDS: dict[str, dict[str, Any]] = {
    "InferencePool": {
        "plural": "inferencepools",
        "doc": "The vLLM engine pods of one model, their KV-cache settings and tier defaults.",
        "short": ["kvpool"],
        "spec": InferencePoolSpec,
        "status": InferencePoolStatus,
        "columns": _columns(
            [
                _column("Model", ".spec.model"),
                _column("Engines", ".status.engines.ready", "integer"),
                _column("Capacity", ".status.capacityBlocks", "integer"),
                _column("Used", ".status.usedBlocks", "integer"),
            ],
            beside_ready=ConditionType.SYNCED,
            leased=".status.leasedBlocks",
            wide=[_column("Tenants", ".status.tenants", "integer", priority=1)],
        ),
    },
    "TenantQuota": {
        "plural": "tenantquotas",
        "doc": "A tenant's tier and its guaranteed and maximum KV-cache blocks in one pool.",
        "short": ["tq"],
        "spec": TenantQuotaSpec,
        "status": TenantQuotaStatus,
        "rules": [
            {
                "rule": "has(self.spec.tenantId) || (size(self.metadata.name) <= 63 && "
                f"self.metadata.name.matches('{TENANT_ID_PATTERN}'))",
                "message": "metadata.name must be a valid tenant id (at most 63 characters) "
                "when spec.tenantId is not set",
            }
        ],
        "columns": _columns(
            [
                _column("Pool", ".spec.poolRef.name"),
                _column("Tier", ".spec.tier"),
                _column("Guaranteed", ".spec.kvCache.guaranteedBlocks", "integer"),
                _column("Max", ".spec.kvCache.maxBlocks", "integer"),
                _column("Used", ".status.usage.blocks", "integer"),
                # Why Accepted is what it is: a quota whose maxBlocks no engine can give
                # (MaxBlocksUnreachable) or that borrows only (Oversubscribed) shows here.
                _column("Quota", f'.status.conditions[?(@.type=="{ConditionType.ACCEPTED}")]'
                                 ".reason"),
            ],
            beside_ready=ConditionType.ACCEPTED,
            leased=".status.usage.leasedBlocks",
            wide=[_column("Tenant", ".spec.tenantId", priority=1)],
        ),
    },
}


# The descriptions of the nodes every Kubernetes object has (the API conventions').
_API_VERSION_DOC = (
    "The API group and version this object is written in (group/version). The API server "
    "converts between the versions it serves and may refuse ones it does not know."
)
_KIND_DOC = (
    "The type of the object ({kind}), in CamelCase: the REST resource it represents. The "
    "API server can tell it from the endpoint a request is sent to."
)
_SPEC_DOC = "The desired state, written by the user."
_STATUS_DOC = "The observed state, written by the operator; users do not set it."


class _WithFactoryDefaults(GenerateJsonSchema):
    """Emit `default` for fields with a default_factory, so nested defaults apply."""

    def default_schema(self, schema: Any) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            schema = {k: v for k, v in schema.items() if k != "default_factory"}
            value = factory()
            schema["default"] = (
                value.model_dump(mode="json", by_alias=True, exclude_none=True)
                if isinstance(value, BaseModel) else value
            )
        return super().default_schema(schema)


def _strip_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Turn pydantic's JSON Schema into a Kubernetes structural schema."""
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _structural(defs[node["$ref"].split("/")[-1]], defs)
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **_structural(extra, defs)}
    if "anyOf" in node:  # Optional[X]: optional in Kubernetes is "absent", never null
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unions are not structural: {node}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        merged = {**_structural(options[0], defs), **_structural(rest, defs)}
        if merged.get("default") is None:
            merged.pop("default", None)
        return merged
    if "const" in node:
        node = {**{k: v for k, v in node.items() if k != "const"}, "enum": [node["const"]]}
    if "exclusiveMinimum" in node or "exclusiveMaximum" in node:
        raise ValueError("exclusive bounds differ between OpenAPI v3.0 and JSON Schema: use CEL")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "default":
            out[key] = _strip_nulls(value)
        elif key == "description":  # a docstring's line breaks are the source's wrapping
            out[key] = " ".join(value.split())
        elif key in _KEEP_KEYS:
            out[key] = value
        elif key not in _DROP_KEYS and key != "$defs":
            raise ValueError(f"unsupported JSON Schema keyword {key!r}")
    if isinstance(node.get("additionalProperties"), dict):  # a map
        out["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def schema_for(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, schema_generator=_WithFactoryDefaults)
    return dict(_structural(raw, raw.get("$defs", {})))


def build_crd(kind: str) -> dict[str, Any]:
    info = KINDS[kind]
    spec_schema = schema_for(info["spec"])
    status_schema = schema_for(info["status"])
    status_schema.pop("required", None)
    root = {
        "type": "object",
        "description": info["doc"],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": _API_VERSION_DOC},
            "kind": {"type": "string", "description": _KIND_DOC.format(kind=kind)},
            # Only `type`: the API server refuses anything else on the root metadata
            # (it documents ObjectMeta itself; `kubectl explain` shows that).
            "metadata": {"type": "object"},
            "spec": {**spec_schema, "description": _SPEC_DOC},
            "status": {**status_schema, "description": _STATUS_DOC},
        },
    }
    if info.get("rules"):
        root["x-kubernetes-validations"] = info["rules"]
    plural = info["plural"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvquota"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": info["short"],
                "categories": ["kvquota"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": info["columns"],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crd_path(out: Path, kind: str) -> Path:
    return out / f"{GROUP}_{KINDS[kind]['plural']}.yaml"


def render(kind: str) -> str:
    header = "# Generated by `kvquota crds` from operator/kvquota/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(kind), sort_keys=False, width=100)


def load_crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of `kind`, as generated (what the API server would enforce)."""
    schema: dict[str, Any] = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def write_or_check(out: Path, check: bool) -> list[str]:
    """Write every CRD, or with `check` return the drift as unified diffs."""
    drift: list[str] = []
    for kind in KINDS:
        path, text = crd_path(out, kind), render(kind)
        if check:
            current = path.read_text() if path.exists() else ""
            if current != text:
                drift.extend(difflib.unified_diff(
                    current.splitlines(), text.splitlines(), str(path), "generated", lineterm=""
                ))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return drift


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "crds", help="generate the CRDs from the API models", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the files differ from the models"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.check and not args.out.is_dir():
        print(f"kvquota crds --check: no directory {args.out}: run it from the repository "
              "root or pass --out DIR", file=sys.stderr)
        return 2
    drift = write_or_check(args.out, args.check)
    if drift:
        print("\n".join(drift))
        print("CRDs are out of date: run `kvquota crds`", file=sys.stderr)
        return 1
    if not args.check:
        print(f"wrote {', '.join(str(crd_path(args.out, k)) for k in KINDS)}")
    return 0
