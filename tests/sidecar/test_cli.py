"""`kvquota sidecar` flags and `kvquota install-plugin`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sidecar.cli import check_server_flags, install_plugin, parse_listen
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
    assert (installed / "scheduler.py").is_file() and (installed / "policy.py").is_file()
    assert not (installed / "stale.py").exists()
    assert not list(installed.rglob("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import engine_sidecar.policy as p; print(p.__file__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(installed))
