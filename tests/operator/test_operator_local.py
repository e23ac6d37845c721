"""Local mode end to end on manifests/samples: files in, policy and status files out.

Watch mode runs in the test's own thread: `run_local(wait=...)` is handed a script of
steps, one per watch interval (an edit, or a check of what the last render wrote), so
every test here is deterministic and none sleeps.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_objects import quota

from engine_sidecar.contract.policy import EnginePolicy
from kvquota import local
from kvquota.api.validation import describe, validate_object
from kvquota.cli import main as kvquota_main
from kvquota.local import default_output, render, run_local, scan

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"
POLICY = Path("policies/default.demo-pool.json")
NEWCOMER_STATUS = Path("status/default.tenantquota.newcomer.yaml")


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Default outputs land here, never in the real user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A GitOps-like checkout holding the samples (plus their kustomization.yaml)."""
    shutil.copytree(SAMPLES, tmp_path / "samples")
    return tmp_path / "samples"


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "rendered"


def _render(repo: Path, out: Path, **options: Any) -> local.Report:
    return render(scan(repo), out, **options)


def _status(out: Path, kind: str, name: str) -> dict:
    data = yaml.safe_load((out / "status" / f"default.{kind}.{name}.yaml").read_text())
    return dict(data)


def _condition(doc: dict, type_: str) -> dict:
    return next(c for c in doc["status"]["conditions"] if c["type"] == type_)


def _add(repo: Path, name: str, *docs: dict) -> None:
    (repo / name).write_text(yaml.safe_dump_all(docs))


def _tenants(out: Path) -> dict:
    if not (out / POLICY).exists():
        return {}
    return dict(EnginePolicy.from_json((out / POLICY).read_text()).tenants)


def _tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry below `root`, hidden ones included: mode and content (None for a
    directory)."""
    return {str(p.relative_to(root)): (p.stat().st_mode, None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def _ticks(*steps: Callable[[], None]) -> Callable[[float], bool]:
    """A `wait` for run_local: each call is one watch interval passing. It runs the next
    step, then lets the watcher scan; once no steps are left it stops the watcher."""
    remaining = list(steps)

    def wait(_interval: float) -> bool:
        if not remaining:
            return True
        remaining.pop(0)()
        return False

    return wait


def _idle() -> None:
    """An interval in which nothing changes (a changed tree renders once it is stable)."""


def test_samples_render_policy_and_status_files(repo: Path, out: Path) -> None:
    stdout = io.StringIO()
    assert run_local(repo, once=True, output=out, replicas=2, stdout=stdout) == 0
    policy = EnginePolicy.from_json((out / POLICY).read_text())  # what the sidecar loads
    assert policy.pool == "default/demo-pool"
    assert sorted(policy.tenants) == ["acme", "globex", "hobbyist"]
    assert policy.tenants["acme"].guaranteed_blocks == 128  # 256 split over 2 replicas
    acme = _status(out, "tenantquota", "acme")
    assert acme["metadata"] == {"name": "acme", "namespace": "default"}
    assert _condition(acme, "Accepted")["status"] == "True"
    assert acme["status"]["effective"]["guaranteedBlocksPerEngine"] == 128
    pool = _status(out, "inferencepool", "demo-pool")
    assert pool["status"]["policyHash"] == policy.version
    assert "TenantQuota default/acme: Accepted=True" in stdout.getvalue()


def test_the_input_directory_is_left_untouched(
    repo: Path, cache_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(repo)
    stdout = io.StringIO()
    assert run_local(repo, once=True, stdout=stdout) == 0
    assert run_local(repo, once=False, stdout=stdout, wait=_ticks(_idle, _idle)) == 0
    assert kvquota_main(["operator", "--local", str(repo), "--once"]) == 0
    assert _tree(repo) == before
    # The default output is a cache directory of this input's own, named on start.
    output = default_output(repo)
    assert output.parent == cache_home / "kvquota" / "local"
    assert output.name.startswith("samples-")
    assert f"writing {output / 'policies'}/ and {output / 'status'}/" in stdout.getvalue()
    assert str(output) in capsys.readouterr().out
    assert "acme" in _tenants(output)


def test_each_input_directory_has_its_own_default_output(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "samples", tmp_path / "b" / "samples"
    assert default_output(a) != default_output(b)
    assert default_output(a) == default_output(tmp_path / "b" / ".." / "a" / "samples")


def test_an_output_inside_the_input_is_not_read_back(repo: Path) -> None:
    inside = repo / "rendered"
    for _ in range(2):  # the second run finds the first one's status files in the tree
        stderr = io.StringIO()
        assert run_local(repo, once=True, output=inside, stdout=io.StringIO(),
                         stderr=stderr) == 0, stderr.getvalue()
    assert "acme" in _tenants(inside)


def test_the_output_cannot_be_the_input_directory(repo: Path) -> None:
    before, stderr = _tree(repo), io.StringIO()
    assert run_local(repo, once=True, output=repo, stdout=io.StringIO(), stderr=stderr) == 2
    assert "never writes into its input" in stderr.getvalue()
    assert _tree(repo) == before


def test_unchanged_objects_rewrite_nothing(repo: Path, out: Path) -> None:
    _render(repo, out)
    before = (out / POLICY).stat().st_mtime_ns
    again = _render(repo, out)
    assert again.written == []
    assert (out / POLICY).stat().st_mtime_ns == before


def test_invalid_object_is_refused_with_the_crd_message(repo: Path, out: Path) -> None:
    bad = quota("bad", guaranteed=10, maximum=5)
    _add(repo, "bad.yaml", bad)
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(), stderr=stderr) == 1
    expected = describe(bad, validate_object(dict(bad)))
    assert "spec.kvCache: Invalid value: maxBlocks (5) must be >= guaranteedBlocks (10)" in expected
    assert expected in stderr.getvalue()
    assert "bad" not in _tenants(out)
    assert not (out / "status/default.tenantquota.bad.yaml").exists()


def test_once_fails_on_a_quota_that_is_not_accepted(repo: Path, out: Path) -> None:
    _add(repo, "typo.yaml", quota("typo", pool="demo-pol"))
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(), stderr=stderr) == 1
    assert "PoolNotFound" in stderr.getvalue()
    assert _condition(_status(out, "tenantquota", "typo"), "Ready")["reason"] == "PoolNotFound"


def test_oversubscription_uses_creation_time_then_file_order(repo: Path, out: Path) -> None:
    # The samples guarantee 352 of 544 guaranteeable blocks; these two cannot both fit.
    _add(repo, "zz-later-file.yaml",
         quota("early", guaranteed=150, maximum=200, created="2020-01-01T00:00:00Z"))
    _add(repo, "aa-early-file.yaml", quota("late", guaranteed=150, maximum=200))
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(),
                     stderr=io.StringIO()) == 1
    # With a timestamp, "early" is older than everything from files without one.
    assert _condition(_status(out, "tenantquota", "early"), "Accepted")["status"] == "True"
    # "late" comes first by file order, so it is older than the samples: they lose.
    assert _condition(_status(out, "tenantquota", "late"), "Accepted")["status"] == "True"
    refused = [n for n in ("acme", "globex")
               if _condition(_status(out, "tenantquota", n), "Accepted")["status"] == "False"]
    assert refused == ["acme", "globex"]  # acme does not fit; globex waits behind it


def test_transition_time_survives_rerenders(repo: Path, out: Path) -> None:
    _render(repo, out, now=datetime(2026, 1, 1, tzinfo=UTC))
    _render(repo, out, now=datetime(2026, 1, 2, tzinfo=UTC))
    accepted = _condition(_status(out, "tenantquota", "acme"), "Accepted")
    assert accepted["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_watch_mode_rerenders_when_files_change(repo: Path, out: Path) -> None:
    log = io.StringIO()

    def add_newcomer() -> None:
        assert "acme" in _tenants(out)  # the first render is complete before any wait
        _add(repo, "newcomer.yaml", quota("newcomer", guaranteed=8, maximum=16))

    def remove_newcomer() -> None:
        assert "newcomer" in _tenants(out), log.getvalue()
        assert (out / NEWCOMER_STATUS).exists()
        (repo / "newcomer.yaml").unlink()

    wait = _ticks(add_newcomer, _idle, remove_newcomer, _idle)
    assert run_local(repo, once=False, output=out, stdout=log, stderr=log, wait=wait) == 0
    assert "newcomer" not in _tenants(out)
    assert not (out / NEWCOMER_STATUS).exists()
    assert log.getvalue().count("-- re-rendered") == 2


def test_watch_mode_renders_an_edit_saved_while_a_render_runs(
    repo: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The edit lands after the render read its input: the next scan must see it (the
    flaky CI run: the watcher took its fingerprint after the first render)."""
    first_render = local.render

    def render_then_edit(*args: Any, **kwargs: Any) -> local.Report:
        report = first_render(*args, **kwargs)
        if not (repo / "newcomer.yaml").exists():
            _add(repo, "newcomer.yaml", quota("newcomer", guaranteed=8, maximum=16))
        return report

    monkeypatch.setattr(local, "render", render_then_edit)
    assert run_local(repo, once=False, output=out, stdout=io.StringIO(),
                     wait=_ticks(_idle, _idle)) == 0
    assert "newcomer" in _tenants(out)


def test_watch_mode_sees_an_edit_that_keeps_size_and_mtime(repo: Path, out: Path) -> None:
    """Two saves within one tick of a coarse mtime clock leave the same mtime."""
    premium = repo / "tenantquota-premium.yaml"

    def edit_in_place() -> None:
        assert _tenants(out)["acme"].guaranteed_blocks == 256
        before = premium.stat()
        premium.write_text(premium.read_text().replace("guaranteedBlocks: 256",
                                                       "guaranteedBlocks: 200"))
        os.utime(premium, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert premium.stat().st_size == before.st_size

    assert run_local(repo, once=False, output=out, stdout=io.StringIO(),
                     wait=_ticks(edit_in_place, _idle)) == 0
    assert _tenants(out)["acme"].guaranteed_blocks == 200


def test_watch_mode_does_not_render_a_file_caught_mid_write(repo: Path, out: Path) -> None:
    text = yaml.safe_dump(quota("newcomer", guaranteed=8, maximum=16))
    newcomer, log = repo / "newcomer.yaml", io.StringIO()

    def write_first_half() -> None:
        newcomer.write_text(text[: len(text) // 2])

    def write_second_half() -> None:
        with newcomer.open("a") as handle:
            handle.write(text[len(text) // 2:])

    wait = _ticks(write_first_half, write_second_half, _idle)
    assert run_local(repo, once=False, output=out, stdout=log, stderr=log, wait=wait) == 0
    assert "newcomer" in _tenants(out)
    assert log.getvalue().count("-- re-rendered") == 1
    assert "newcomer.yaml" not in log.getvalue()  # no error about the half-written file


def test_invalid_update_keeps_the_object_as_the_cluster_would(repo: Path, out: Path) -> None:
    previous: dict = {}
    _add(repo, "pinned.yaml", quota("pinned", tenantId="pinned-id"))
    _render(repo, out, previous=previous)
    _add(repo, "pinned.yaml", quota("pinned", tenantId="renamed-id"))
    report = _render(repo, out, previous=previous)
    assert any("tenantId is immutable" in e for e in report.errors)
    tenants = _tenants(out)
    assert "pinned-id" in tenants and "renamed-id" not in tenants


def test_cli_check_of_a_gitops_directory(
    repo: Path, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["operator", "--local", str(repo), "--out", str(out), "--once"]
    assert kvquota_main(command) == 0
    assert "acme" in _tenants(out)
    _add(repo, "typo.yaml", quota("typo", pool="nope"))
    assert kvquota_main(command) == 1
    assert "typo" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="need --local"):
        kvquota_main(["operator", "--out", str(out)])


# ------------------------------------------ what `kubectl apply` would say (#15.6)


@pytest.mark.parametrize(("api_version", "kind", "hint"), [
    ("kvquota.dev/v1alpha1", "TenantQuotas", "did you mean kind TenantQuota?"),
    ("kvquota.io/v1alpha1", "TenantQuota", "did you mean group kvquota.dev?"),
    ("kvquota.dev/v1", "TenantQuota", "did you mean version v1alpha1"),
    ("v1", "TenantQuota", "did you mean group kvquota.dev?"),
    ("kvquota.dev/v1alpha1", "Quota", "expected apiVersion kvquota.dev/v1alpha1"),
])
def test_an_unknown_kind_or_group_of_ours_is_an_error(
    repo: Path, out: Path, api_version: str, kind: str, hint: str
) -> None:
    typo = {**quota("typo"), "apiVersion": api_version, "kind": kind}
    _add(repo, "typo.yaml", typo)
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(), stderr=stderr) == 1
    message = stderr.getvalue()
    assert f'typo.yaml#0: default/typo: no matches for kind "{kind}" in version ' \
           f'"{api_version}"' in message
    assert hint in message
    assert sorted(_tenants(out)) == ["acme", "globex", "hobbyist"]  # the rest still renders


def test_objects_of_other_apis_are_not_ours_to_judge(repo: Path, out: Path) -> None:
    """A GitOps directory holds Deployments, kustomizations and the Gateway API inference
    extension's own InferencePool: none of them is an error here."""
    gateway_pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                    "metadata": {"name": "gw"}, "spec": {"targetPorts": [{"number": 8000}]}}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    _add(repo, "others.yaml", gateway_pool, config)
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(), stderr=stderr) == 0
    assert stderr.getvalue() == ""


def _samples_with(repo: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = next(p for p in sorted(repo.glob("*.yaml"))
                if yaml.safe_load(p.read_text()).get("metadata", {}).get("name") == name)
    body = yaml.safe_load(path.read_text())
    edit(body["spec"])
    path.write_text(yaml.safe_dump(body))


def _refusal(repo: Path, out: Path) -> str:
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, stdout=io.StringIO(), stderr=stderr) == 1
    return stderr.getvalue()


def test_lease_max_blocks_above_the_tenants_max_blocks_is_refused(repo: Path, out: Path) -> None:
    _samples_with(repo, "acme", lambda spec: spec["kvCache"]["lease"].update(maxBlocks=500))
    message = _refusal(repo, out)
    assert ('tenantquotas.kvquota.dev "acme" is invalid: spec.kvCache: Invalid value: '
            'lease.maxBlocks (500) must be <= maxBlocks (448)') in message
    assert "acme" not in _tenants(out)


def test_lease_max_blocks_equal_to_max_blocks_is_fine(repo: Path, out: Path) -> None:
    _samples_with(repo, "acme", lambda spec: spec["kvCache"]["lease"].update(maxBlocks=448))
    assert run_local(repo, once=True, output=out, stdout=io.StringIO()) == 0


@pytest.mark.parametrize(("block_size", "expected"), [
    (24, "spec.kvCache.blockSize: Invalid value: 24: spec.kvCache.blockSize in body should "
         "be a multiple of 16"),
    (8, "spec.kvCache.blockSize: Invalid value: 8: spec.kvCache.blockSize in body should be "
        "greater than or equal to 16"),
    (4096, "spec.kvCache.blockSize: Invalid value: 4096: spec.kvCache.blockSize in body "
           "should be less than or equal to 2048"),
])
def test_block_size_is_bounded_to_what_vllm_kernels_take(
    repo: Path, out: Path, block_size: int, expected: str
) -> None:
    _samples_with(repo, "demo-pool",
                  lambda spec: spec["kvCache"].update(blockSize=block_size))
    assert expected in _refusal(repo, out)


def test_watermark_message_shows_the_bad_value(repo: Path, out: Path) -> None:
    _samples_with(repo, "demo-pool", lambda spec: spec["kvCache"].update(watermark=0.55))
    assert ("spec.kvCache.watermark: Invalid value: 0.55: kvCache.watermark must be >= 0 "
            "and < 0.5") in _refusal(repo, out)


def test_max_blocks_above_pool_capacity_gets_a_condition_and_a_warning(
    repo: Path, out: Path
) -> None:
    """The samples' pool holds 640 blocks per engine; 2 replicas make 1280."""
    _samples_with(repo, "globex", lambda spec: spec["kvCache"].update(maxBlocks=5000))
    stderr = io.StringIO()
    assert run_local(repo, once=True, output=out, replicas=2, stdout=io.StringIO(),
                     stderr=stderr) == 0  # accepted: a warning, not an error
    accepted = _condition(_status(out, "tenantquota", "globex"), "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("True", "MaxBlocksAboveCapacity")
    assert "maxBlocks 5000 is above the pool's capacity of 1280 blocks" in accepted["message"]
    assert stderr.getvalue().startswith("warning: TenantQuota default/globex "
                                        "(MaxBlocksAboveCapacity): ")
    acme = _condition(_status(out, "tenantquota", "acme"), "Accepted")
    assert acme["reason"] == "Accepted"  # 448 fits: no warning for the others
