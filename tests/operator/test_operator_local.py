"""Local mode end to end on manifests/samples: files in, policy and status files out."""

from __future__ import annotations

import io
import shutil
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from operator_objects import quota

from engine_sidecar.policy import EnginePolicy
from kvquota.cli import main as kvquota_main
from kvquota.local import render, run_local
from kvquota.validation import describe, validate_object

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"
POLICY = Path(".policies/default.demo-pool.json")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A GitOps-like checkout holding the samples (plus their kustomization.yaml)."""
    shutil.copytree(SAMPLES, tmp_path / "samples")
    return tmp_path / "samples"


def _status(repo: Path, kind: str, name: str) -> dict:
    data = yaml.safe_load((repo / ".status" / f"default.{kind}.{name}.yaml").read_text())
    return dict(data)


def _condition(doc: dict, type_: str) -> dict:
    return next(c for c in doc["status"]["conditions"] if c["type"] == type_)


def _add(repo: Path, name: str, *docs: dict) -> None:
    (repo / name).write_text(yaml.safe_dump_all(docs))


def test_samples_render_policy_and_status_files(repo: Path) -> None:
    out = io.StringIO()
    assert run_local(repo, once=True, replicas=2, out=out) == 0
    policy = EnginePolicy.from_json((repo / POLICY).read_text())  # what the sidecar loads
    assert policy.pool == "default/demo-pool"
    assert sorted(policy.tenants) == ["acme", "globex", "hobbyist"]
    assert policy.tenants["acme"].guaranteed_blocks == 128  # 256 split over 2 replicas
    acme = _status(repo, "tenantquota", "acme")
    assert acme["metadata"] == {"name": "acme", "namespace": "default"}
    assert _condition(acme, "Accepted")["status"] == "True"
    assert acme["status"]["effective"]["guaranteedBlocksPerEngine"] == 128
    pool = _status(repo, "inferencepool", "demo-pool")
    assert pool["status"]["policyHash"] == policy.version
    assert "TenantQuota default/acme: Accepted=True" in out.getvalue()


def test_unchanged_objects_rewrite_nothing(repo: Path) -> None:
    render(repo)
    before = (repo / POLICY).stat().st_mtime_ns
    again = render(repo)
    assert again.written == []
    assert (repo / POLICY).stat().st_mtime_ns == before


def test_invalid_object_is_refused_with_the_crd_message(repo: Path) -> None:
    bad = quota("bad", guaranteed=10, maximum=5)
    _add(repo, "bad.yaml", bad)
    err = io.StringIO()
    assert run_local(repo, once=True, out=io.StringIO(), err=err) == 1
    expected = describe(bad, validate_object(dict(bad)))
    assert "maxBlocks must be >= guaranteedBlocks" in expected
    assert expected in err.getvalue()
    assert "bad" not in EnginePolicy.from_json((repo / POLICY).read_text()).tenants
    assert not (repo / ".status/default.tenantquota.bad.yaml").exists()


def test_once_fails_on_a_quota_that_is_not_accepted(repo: Path) -> None:
    _add(repo, "typo.yaml", quota("typo", pool="demo-pol"))
    err = io.StringIO()
    assert run_local(repo, once=True, out=io.StringIO(), err=err) == 1
    assert "PoolNotFound" in err.getvalue()
    assert _condition(_status(repo, "tenantquota", "typo"), "Ready")["reason"] == "PoolNotFound"


def test_oversubscription_uses_creation_time_then_file_order(repo: Path) -> None:
    # The samples guarantee 352 of 544 guaranteeable blocks; these two cannot both fit.
    _add(repo, "zz-later-file.yaml",
         quota("early", guaranteed=150, maximum=200, created="2020-01-01T00:00:00Z"))
    _add(repo, "aa-early-file.yaml", quota("late", guaranteed=150, maximum=200))
    assert run_local(repo, once=True, out=io.StringIO(), err=io.StringIO()) == 1
    # With a timestamp, "early" is older than everything from files without one.
    assert _condition(_status(repo, "tenantquota", "early"), "Accepted")["status"] == "True"
    # "late" comes first by file order, so it is older than the samples: they lose.
    assert _condition(_status(repo, "tenantquota", "late"), "Accepted")["status"] == "True"
    refused = [n for n in ("acme", "globex")
               if _condition(_status(repo, "tenantquota", n), "Accepted")["status"] == "False"]
    assert refused == ["acme", "globex"]  # acme does not fit; globex waits behind it


def test_transition_time_survives_rerenders(repo: Path) -> None:
    render(repo, now=datetime(2026, 1, 1, tzinfo=UTC))
    render(repo, now=datetime(2026, 1, 2, tzinfo=UTC))
    accepted = _condition(_status(repo, "tenantquota", "acme"), "Accepted")
    assert accepted["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def _wait_until(check: Callable[[], bool], what: str, log: io.StringIO,
                timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s; local mode said:\n{log.getvalue()}")


def _tenants(repo: Path) -> dict:
    if not (repo / POLICY).exists():
        return {}
    return dict(EnginePolicy.from_json((repo / POLICY).read_text()).tenants)


def test_watch_mode_rerenders_when_files_change(repo: Path) -> None:
    stop, log = threading.Event(), io.StringIO()
    watcher = threading.Thread(target=run_local, args=(repo,), daemon=True, kwargs={
        "once": False, "interval": 0.05, "out": log, "err": log, "stop": stop})
    watcher.start()
    try:
        _wait_until(lambda: "acme" in _tenants(repo), "first render", log)
        _add(repo, "newcomer.yaml", quota("newcomer", guaranteed=8, maximum=16))
        _wait_until(lambda: "newcomer" in _tenants(repo), "re-rendered with newcomer", log)
        (repo / "newcomer.yaml").unlink()
        _wait_until(lambda: not (repo / ".status/default.tenantquota.newcomer.yaml").exists(),
                    "the removed quota's status file deleted", log)
        assert "newcomer" not in _tenants(repo)
    finally:
        stop.set()
        watcher.join(5)


def test_invalid_update_keeps_the_object_as_the_cluster_would(repo: Path) -> None:
    previous: dict = {}
    _add(repo, "pinned.yaml", quota("pinned", tenantId="pinned-id"))
    render(repo, previous=previous)
    _add(repo, "pinned.yaml", quota("pinned", tenantId="renamed-id"))
    report = render(repo, previous=previous)
    assert any("tenantId is immutable" in e for e in report.errors)
    tenants = EnginePolicy.from_json((repo / POLICY).read_text()).tenants
    assert "pinned-id" in tenants and "renamed-id" not in tenants


def test_cli_check_of_a_gitops_directory(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvquota_main(["operator", "--local", str(repo), "--once"]) == 0
    _add(repo, "typo.yaml", quota("typo", pool="nope"))
    assert kvquota_main(["operator", "--local", str(repo), "--once"]) == 1
    assert "typo" in capsys.readouterr().err
