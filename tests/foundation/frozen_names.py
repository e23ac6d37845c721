"""Where each kind of frozen name is looked up in the product as it is now.

`frozen_names.yaml` says which names must keep working; these say which do. Each kind
is read where it is defined, without starting anything (no vLLM import):

- python: a module that can be found, and a module-level name it binds;
- flags: the option strings of `kvquota <command>`'s own parser;
- conditions: the operator's ConditionType and ConditionReason enums;
- crd: field paths and names of the CRDs in crds/ (what `kubectl apply` installs);
- every other kind (env, headers, keys, error codes, metrics and their labels): a
  string the product's code holds, literal or built from module constants
  (`f"{GROUP}/pool"`). A name kept only in the table of renamed names does not count.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PRODUCT = (REPO / "engine_sidecar", REPO / "operator" / "kvquota")
RENAMED_TABLE = REPO / "engine_sidecar" / "contract" / "renamed.py"
FROZEN = Path(__file__).with_name("frozen_names.yaml")
COMMANDS = ("sidecar", "operator", "inject", "install-plugin")


def frozen() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(FROZEN.read_text())
    return data


def _module_files() -> Iterator[Path]:
    for root in PRODUCT:
        yield from (p for p in sorted(root.rglob("*.py")) if p != RENAMED_TABLE)


def _value(node: ast.AST, constants: dict[str, str]) -> str | None:
    """A string expression's value: a literal, bytes, or an f-string of constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        return node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            inner = part.value if isinstance(part, ast.FormattedValue) else part
            value = _value(inner, constants)
            if value is None:
                return None
            parts.append(value)
        return "".join(parts)
    return None


@functools.cache
def _trees() -> tuple[ast.Module, ...]:
    return tuple(ast.parse(p.read_text()) for p in _module_files())


@functools.cache
def _constants() -> dict[str, str]:
    """Module-level string constants of the product, by name."""
    constants: dict[str, str] = {}
    for _ in range(2):  # constants built from constants of other modules
        for tree in _trees():
            for node in tree.body:
                target = (node.targets[0] if isinstance(node, ast.Assign) and
                          len(node.targets) == 1 else
                          node.target if isinstance(node, ast.AnnAssign) and node.value else
                          None)
                value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
                if isinstance(target, ast.Name) and value is not None:
                    found = _value(value, constants)
                    if found is not None:
                        constants[target.id] = found
    return constants


@functools.cache
def product_strings() -> frozenset[str]:
    found = set()
    for tree in _trees():
        for node in ast.walk(tree):
            value = _value(node, _constants()) if not isinstance(node, ast.Name) else None
            if value:
                found.add(value)
    return frozenset(found)


METRIC_TYPES = ("Counter", "Gauge", "Histogram", "GaugeMetricFamily", "CounterMetricFamily")


@functools.cache
def metric_labels() -> dict[str, frozenset[str]]:
    """Each metric family the product defines -> its label names, as its constructor
    names them (counters are exposed with `_total`, histograms with `_bucket`...)."""
    found: dict[str, frozenset[str]] = {}
    for tree in _trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args and
                    ast.unparse(node.func).split(".")[-1] in METRIC_TYPES):
                continue
            name = _value(node.args[0], _constants())
            labels = next((k.value for k in node.keywords if k.arg in ("labels", "labelnames")),
                          node.args[2] if len(node.args) > 2 else None)
            elements = labels.elts if isinstance(labels, ast.List | ast.Tuple) else []
            if name:
                found[name] = frozenset(v for e in elements
                                        if (v := _value(e, _constants())) is not None)
    return found


def module_file(module: str) -> Path | None:
    """The source file of `module`, found without importing it or its parents (the
    plugin's modules import vLLM)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent
    for part in rest:
        path = path / part
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if rest and candidate.is_file():
            return candidate
    return Path(spec.origin) if not rest else None


def _module_binds(module: str) -> set[str] | None:
    """The names a module binds at its top level (None: no such module)."""
    source = module_file(module)
    if source is None:
        return None
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
            names |= _module_binds(node.module or "") or set()
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def python_path_works(path: str) -> bool:
    """`path` names a module, or a name a module binds (`module.Class`)."""
    if module_file(path) is not None:
        return True
    module, _, name = path.rpartition(".")
    binds = _module_binds(module)
    return binds is not None and name in binds


def warns_when_imported(path: str, old: str) -> bool:
    """The module `path` names (or the module of the name it names) calls
    warn_renamed(old) at its top level."""
    source = module_file(path) or module_file(path.rpartition(".")[0])
    return source is not None and any(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
        and ast.unparse(n.value) == f"warn_renamed({old!r})"
        for n in ast.parse(source.read_text()).body)


@functools.cache
def command_flags() -> dict[str, frozenset[str]]:
    from kvquota.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    choices: dict[str, Any] = sub.choices  # type: ignore[assignment]
    return {command: frozenset(flag for action in choices[command]._actions
                               for flag in action.option_strings)
            for command in COMMANDS}


def condition_names() -> dict[str, frozenset[str]]:
    from kvquota.api import ConditionReason, ConditionType

    return {"types": frozenset(ConditionType), "reasons": frozenset(ConditionReason)}


def _schema_paths(schema: dict[str, Any], prefix: str) -> Iterator[str]:
    for name, child in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        yield path
        yield from _schema_paths(child, path + ".")
        if isinstance(child.get("items"), dict):
            yield from _schema_paths(child["items"], path + "[].")
        if isinstance(child.get("additionalProperties"), dict):
            yield from _schema_paths(child["additionalProperties"], path + ".*.")


@functools.cache
def crd_names() -> dict[str, frozenset[str]]:
    """kind -> its field paths in every served version, plus `names:` entries (the
    CRD's name, plural, singular, short names)."""
    found: dict[str, frozenset[str]] = {}
    for path in sorted((REPO / "crds").glob("kvquota.dev_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names = crd["spec"]["names"]
        entries = {f"names: {crd['metadata']['name']}", f"names: {names['plural']}",
                   f"names: {names['singular']}"}
        entries |= {f"names: {short}" for short in names.get("shortNames", [])}
        for version in crd["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            entries |= {f"{version['name']} {p}" for p in _schema_paths(schema, "")
                        if p.split(".")[0] in ("spec", "status")}
        found[names["kind"]] = frozenset(entries)
    return found


def unfrozen() -> dict[str, Any]:
    """What the product has that the list does not (for the kinds it can enumerate), in
    the list's own shape: paste what should be frozen into frozen_names.yaml."""
    names = frozen()
    flags = {c: sorted(f for f in command_flags()[c] - set(names["flags"][c])
                       if f not in ("-h", "--help")) for c in COMMANDS}
    conditions = {k: sorted(str(v) for v in condition_names()[k] - set(names["conditions"][k]))
                  for k in ("types", "reasons")}
    metrics = {m: sorted(labels - set(names["metrics"].get(m, [])))
               for m, labels in metric_labels().items()
               if m not in names["metrics"] or labels - set(names["metrics"][m])}
    crd = {k: sorted(v - set(names["crd"].get(k, []))) for k, v in crd_names().items()}
    found = {"flags": flags, "conditions": conditions, "metrics": metrics, "crd": crd}
    return {kind: {k: v for k, v in entries.items() if v or kind == "metrics"}
            for kind, entries in found.items() if any(entries.values()) or
            (kind == "metrics" and entries)}


if __name__ == "__main__":
    new = unfrozen()
    print(yaml.safe_dump(new, sort_keys=False) if new else "nothing unfrozen", end="")
