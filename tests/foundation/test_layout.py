"""What a newcomer meets first: the CLI, the package layout, the tiny model."""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvquota.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_stdlib_operator_is_not_shadowed_from_the_repo_root() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.itemgetter)"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert "<class 'operator.itemgetter'>" in out.stdout


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    commands = set(sub.choices)  # type: ignore[arg-type]
    assert {"crds", "tiny-model"} <= commands
    for name in commands:
        out = subprocess.run(
            [sys.executable, "-m", "kvquota.cli", name, "--help"],
            capture_output=True, text=True, cwd=REPO,
        )
        assert out.returncode == 0, out.stderr
        assert "usage: kvquota" in out.stdout


def test_without_the_lab_its_commands_say_how_to_install_it() -> None:
    """The images hold no lab: `kvquota demo` there names the extra instead of failing
    on an import or on its arguments."""
    hide_lab = "import sys; sys.modules['kvquota_lab'] = None; from kvquota.cli import main; "
    for argv in (["demo"], ["bench", "suite", "--jobs", "2"], ["tiny-model", "--out", "m"]):
        out = subprocess.run(
            [sys.executable, "-c", hide_lab + f"sys.exit(main({argv!r}))"],
            capture_output=True, text=True, cwd=REPO,
        )
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        assert f"kvquota {argv[0]} needs kvquota_lab" in out.stderr
        assert "pip install 'kvquota[lab]'" in out.stderr
    listing = subprocess.run([sys.executable, "-c", hide_lab + "main(['--help'])"],
                             capture_output=True, text=True, cwd=REPO)
    assert "demo          (needs the 'lab' extra)" in listing.stdout
    assert "operator" in listing.stdout


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir()) if p.is_file()
    }


def test_tiny_model_is_deterministic_and_offline(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvquota_lab.tinymodel import generate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = generate(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digest(again))


def test_tiny_model_tokenizer_has_a_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "premium tenant asks"}], add_generation_prompt=True
    )
    text = tokenizer.decode(ids if isinstance(ids, list) else ids["input_ids"])
    assert text.startswith("<|user|>premium tenant asks</s>")
    assert text.endswith("<|assistant|>")


# part -> the parts it may import (anywhere in a module, inside functions too).
LAYERS = {
    "engine_sidecar.contract": {"engine_sidecar.contract"},
    "engine_sidecar.plugin": {"engine_sidecar.contract", "engine_sidecar.plugin"},
    "engine_sidecar.gateway": {"engine_sidecar.contract", "engine_sidecar.gateway"},
    "engine_sidecar.cli": {"engine_sidecar.contract", "engine_sidecar.gateway",
                           "engine_sidecar.plugin"},
    "kvquota": {"engine_sidecar.contract", "kvquota"},
}
# 0.1.0's paths (engine_sidecar/contract/renamed.py): each hands over to its new home.
for _old in ("engine_sidecar.scheduler", "engine_sidecar.preflight", "engine_sidecar.policy"):
    LAYERS[_old] = {"engine_sidecar.contract", "engine_sidecar.plugin"}
ROOTS = {"engine_sidecar": REPO / "engine_sidecar", "kvquota": REPO / "operator" / "kvquota"}


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module can run, inside functions too; not `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from _runtime_imports(node)


def _product_imports(roots: dict[str, Path] = ROOTS) -> dict[str, set[str]]:
    """Each module under `roots` (product code by default) -> the product and lab
    modules (and packages) it imports at run time."""
    found: dict[str, set[str]] = {}
    for package, root in roots.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            imports = found.setdefault(module, set())
            for node in _runtime_imports(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {a.name for a in node.names}
                elif node.level == 0 and node.module:
                    imports |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m: {i for i in imports if i.split(".")[0] in ROOTS | {"kvquota_lab": 0}}
            for m, imports in found.items()}


def _part(module: str) -> str | None:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")),
               key=len, default=None)


def test_product_imports_go_one_way() -> None:
    """The contract imports no other part; the plugin and the gateway only the contract;
    the operator only the contract of the engine side; nothing imports the lab."""
    wrong = []
    for module, imports in _product_imports().items():
        part = _part(module)
        for name in imports:
            target = _part(name)
            if name.startswith("kvquota_lab") or (target and target not in LAYERS[part or ""]):
                wrong.append(f"{module} imports {name}")
    assert wrong == []


def _import_cycles(graph: dict[str, set[str]]) -> list[str]:
    edges = {m: {i for i in imports if i in graph and i != m} for m, imports in graph.items()}
    cycles = []
    for start in sorted(edges):
        seen, todo = set(), [(start, (start,))]
        while todo:
            module, path = todo.pop()
            for target in sorted(edges[module]):
                if target == start:
                    cycles.append(" -> ".join((*path, start)))
                elif target not in seen:
                    seen.add(target)
                    todo.append((target, (*path, target)))
    return cycles


def test_no_import_cycle_in_product_code() -> None:
    """Following run-time imports (inside functions too) from any product module never
    leads back to it."""
    assert _import_cycles(_product_imports()) == []


def test_no_import_cycle_in_the_lab() -> None:
    """Nor from any lab module: a cycle there means a function lives in the wrong file."""
    lab = _product_imports({"kvquota_lab": REPO / "lab" / "kvquota_lab"})
    assert _import_cycles(lab) == []
