"""`kvquota sidecar` flags and `kvquota install-plugin`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sidecar.cli import check_server_flags, install_plugin
from engine_sidecar.contract.listen import parse_listen
from kvquota.cli import build_parser


def test_sidecar_flags_and_defaults(tmp_path: Path) -> None:
    args = build_parser().parse_args(["sidecar", "--policy-file", str(tmp_path / "p.json")])
    assert (args.listen, args.upstream, args.request_timeout) == \
        ("0.0.0.0:8000", "http://127.0.0.1:8001", 600.0)
    configmap = build_parser().parse_args(
        ["sidecar", "--policy-configmap", "pools/demo-kvquota-policy", "--secrets-dir", "/s"])
    assert configmap.policy_configmap == "pools/demo-kvquota-policy"
    with pytest.raises(SystemExit):  # exactly one policy source
        build_parser().parse_args(["sidecar"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--policy-file", "a", "--policy-configmap", "b/c"])


def test_status_and_metrics_get_their_own_port(tmp_path: Path) -> None:
    policy = ["sidecar", "--policy-file", str(tmp_path / "p.json")]
    args = build_parser().parse_args(policy)
    assert check_server_flags(args) == (("0.0.0.0", 8000), ("0.0.0.0", 9100))
    assert (args.header_timeout, args.body_timeout, args.max_connections) == (10.0, 30.0, None)
    same = build_parser().parse_args([*policy, "--admin-listen", "10.0.0.5:8000"])
    with pytest.raises(SystemExit, match="another port than --listen"):
        check_server_flags(same)
    for flag in ("--header-timeout", "--body-timeout", "--max-connections"):
        bad = build_parser().parse_args([*policy, flag, "0"])
        with pytest.raises(SystemExit, match=f"{flag} must be positive"):
            check_server_flags(bad)


def test_listen_addresses() -> None:
    assert parse_listen("0.0.0.0:8000") == ("0.0.0.0", 8000)
    assert parse_listen("[::]:9000") == ("::", 9000)
    for bad in ("8000", "host:", "host:99999"):
        with pytest.raises(SystemExit, match="HOST:PORT"):
            parse_listen(bad)


def test_install_plugin_copies_an_importable_package(tmp_path: Path) -> None:
    target = tmp_path / "plugins"
    first = install_plugin(target)
    (first / "stale.py").write_text("")
    installed = install_plugin(target)  # a second run replaces the copy
    assert installed == target / "engine_sidecar"
    assert (installed / "plugin" / "scheduler.py").is_file()
    assert (installed / "contract" / "policy.py").is_file()
    assert not (installed / "stale.py").exists()
    assert not list(installed.rglob("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import engine_sidecar.plugin.scheduler as p; print(p.__file__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(installed))


def test_install_plugin_writes_the_contract_and_the_plugin_only(tmp_path: Path) -> None:
    """What goes into the vLLM container: no gateway, no CLI, and nothing in the copy
    imports a module the copy lacks (or the operator)."""
    installed = install_plugin(tmp_path)
    assert sorted(p.name for p in installed.iterdir()) == [
        "__init__.py", "contract", "plugin", "policy.py", "preflight.py", "scheduler.py"]
    written = {p.relative_to(installed).with_suffix("").as_posix().replace("/", ".")
               for p in installed.rglob("*.py")}
    modules = {"engine_sidecar." + m.removesuffix(".__init__") for m in written} | {
        "engine_sidecar"}
    assert not any(".gateway" in m or m.endswith(".cli") for m in modules), modules
    for path in installed.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                assert top not in ("kvquota", "kvquota_lab"), f"{path.name} imports {name}"
                if top == "engine_sidecar":
                    assert name in modules, f"{path.name} imports {name}, not in the copy"


REPO = Path(__file__).resolve().parents[2]
OK_LINE = "admit, preempt, lease, finish"


def _kvquota(*argv: str, cwd: Path, first_on_path: Path | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """The `kvquota` command in a fresh process (it imports vLLM)."""
    path = [str(first_on_path)] if first_on_path else []
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([*path, str(REPO), str(REPO / "operator"),
                                          str(REPO / "lab")])}
    env.pop("KVQUOTA_ALLOW_UNSUPPORTED_VLLM", None)
    return subprocess.run([sys.executable, "-m", "kvquota.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_install_plugin_check_checks_the_copy_it_installed(tmp_path: Path) -> None:
    target = tmp_path / "plugins"
    run = _kvquota("install-plugin", "--check", str(target), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"installed {target / 'engine_sidecar'}")
    assert lines[1].startswith(f"checking the plugin at {target / 'engine_sidecar'} on vLLM ")
    assert lines[-1].startswith("ok: vLLM ") and lines[-1].endswith(OK_LINE)


def test_install_plugin_check_fails_naming_what_this_vllm_lacks(tmp_path: Path) -> None:
    """On a vLLM that lost a touchpoint (simulated at interpreter start, in every
    process), the check of the installed copy exits 1 naming it."""
    broken = tmp_path / "broken-vllm"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "from vllm.v1.core.block_pool import BlockPool\ndel BlockPool.touch\n")
    run = _kvquota("install-plugin", "--check", str(tmp_path / "plugins"), cwd=tmp_path,
                   first_on_path=broken)
    assert run.returncode == 1
    assert "missing touchpoint: BlockPool.touch" in run.stderr
    assert run.stderr.splitlines()[-1].startswith("not ok: vLLM ")


def test_install_plugin_check_without_dir_checks_the_package_installed_here(
    tmp_path: Path,
) -> None:
    run = _kvquota("install-plugin", "--check", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"checking the plugin at {REPO / 'engine_sidecar'} on vLLM " in run.stdout
    assert run.stdout.splitlines()[-1].endswith(OK_LINE)
    assert not list(tmp_path.iterdir())  # nothing copied


def test_install_plugin_needs_a_dir_unless_it_only_checks() -> None:
    args = build_parser().parse_args(["install-plugin"])
    with pytest.raises(SystemExit, match="give DIR to copy the plugin into, or --check"):
        args.func(args)
