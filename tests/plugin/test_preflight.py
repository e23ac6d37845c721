"""The pre-flight check (`python -m engine_sidecar.plugin.preflight`), as a user runs it.

It says ok on every verified vLLM release (the installed CPU build here; the others
from the unpacked copies `tests/conformance/prepare.py` makes, in subprocesses with the
copy first on PYTHONPATH) and names what is missing on a broken one.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sidecar.contract.names import STATS_PATH_ENV
from engine_sidecar.plugin import preflight, vllm_compat

REPO = Path(__file__).resolve().parents[2]
# Where prepare.py unpacks each release: <cache>/vllm-<version>/site.
CACHE_ENV = "KVQUOTA_VLLM_CACHE"
OK_STAGES = "admit, preempt, lease, finish"


def _cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO / ".cache")


def _on_unpacked_copy() -> bool:
    """This process runs on a copy put first on PYTHONPATH (a nested cross-version
    run), not on the installed vLLM."""
    import vllm

    installed = [Path(p).resolve() for p in site.getsitepackages()]
    return not any(Path(vllm.__file__).resolve().is_relative_to(p) for p in installed)


def _release_site(version: str) -> Path | None:
    """The directory to put first on PYTHONPATH to run on `version` (None: the installed
    vLLM is that release); skips when it has not been prepared."""
    import vllm

    if vllm.__version__.split("+")[0] == version:
        return None
    release_site = _cache() / f"vllm-{version}" / "site"
    if not (release_site / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM {version} at {release_site}: "
                    f"python tests/conformance/prepare.py site {version}")
    return release_site


def _run_check(*code: str, release_site: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m engine_sidecar.plugin.preflight` in a fresh process, after `code` (which
    may break this vLLM the way a future release might), on `release_site` if given,
    else on this process's vLLM (an unpacked copy stays first on PYTHONPATH)."""
    path = [str(release_site), str(REPO)] if release_site else [
        str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run_env.pop(vllm_compat.ALLOW_UNSUPPORTED_ENV, None)
    script = "\n".join([*code, "import runpy",
                        "runpy.run_module('engine_sidecar.plugin.preflight', run_name='__main__')"])
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(_on_unpacked_copy(), reason="nested run on an unpacked vLLM: the "
                    "top-level run checks every release")
@pytest.mark.parametrize("version", list(vllm_compat.VERIFIED_VLLM))
def test_the_check_says_ok_on_every_verified_release(version: str) -> None:
    release_site = _release_site(version)
    run = _run_check(release_site=release_site)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == f"ok: vLLM {version}: {OK_STAGES}"
    # The vLLM it stepped is the one asked for, with this tree's plugin.
    assert f"on vLLM {version} at {release_site.resolve() if release_site else ''}" in lines[0]
    assert f"the plugin at {REPO / 'engine_sidecar'}" in lines[0]


def test_a_vllm_without_a_touchpoint_fails_naming_it() -> None:
    """A future vLLM that renamed `BlockPool.touch` (what leases pin blocks with)."""
    import vllm

    run = _run_check("from vllm.v1.core.block_pool import BlockPool", "del BlockPool.touch")
    assert run.returncode == 1
    assert "missing touchpoint: BlockPool.touch" in run.stderr
    assert run.stderr.splitlines()[-1].startswith(f"not ok: vLLM {vllm.__version__}: ")
    assert "ok: vLLM" not in run.stdout


def test_a_renamed_scheduler_field_is_named_with_the_stage_that_met_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the version gate cannot see (an attribute set in the constructor): the
    check meets it while stepping and says where."""
    from vllm.v1.core.sched.scheduler import Scheduler

    init = Scheduler.__init__

    def renamed(self: Scheduler, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.inflight_prefills = self.__dict__.pop("_inflight_prefills")  # type: ignore[attr-defined]

    monkeypatch.setattr(Scheduler, "__init__", renamed)
    assert preflight.main([]) == 1
    err = capsys.readouterr().err
    assert "admit: missing attribute Scheduler._inflight_prefills (at " in err
    assert err.splitlines()[-1].startswith("not ok: vLLM ")


def test_an_unverified_but_complete_vllm_is_checked_and_said_to_be_unverified(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check is how a user decides about a newer vLLM: the version gate does not
    stop it, and the output says what the plugin would need to start there."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(vllm_compat.ALLOW_UNSUPPORTED_ENV, raising=False)
    assert preflight.main([]) == 0
    out = capsys.readouterr().out
    assert "note: vLLM 0.99.0 is not a verified release" in out
    assert f"{vllm_compat.ALLOW_UNSUPPORTED_ENV}=1" in out
    assert out.splitlines()[-1] == f"ok: vLLM 0.99.0: {OK_STAGES}"
    assert vllm_compat.ALLOW_UNSUPPORTED_ENV not in os.environ  # only for its own scheduler

    # What the injected init container runs: the engine would refuse to start.
    assert preflight.main(["--strict"]) == 1
    err = capsys.readouterr().err
    assert f"ok: vLLM 0.99.0: {OK_STAGES}" in err
    assert err.splitlines()[-1] == (
        "not ok: the plugin refuses to start on vLLM 0.99.0 unless the engine's container "
        f"sets {vllm_compat.ALLOW_UNSUPPORTED_ENV}=1")
    monkeypatch.setenv(vllm_compat.ALLOW_UNSUPPORTED_ENV, "1")
    assert preflight.main(["--strict"]) == 0


def test_run_by_hand_in_an_engine_container_it_leaves_the_engine_files_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_PATH_ENV, str(stats))
    assert preflight.main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(OK_STAGES)
    assert not stats.exists()
    assert os.environ[STATS_PATH_ENV] == str(stats)


def test_where_vllm_is_not_installed_it_says_where_to_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """E.g. `kvquota install-plugin --check` in the sidecar's image."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails
    assert preflight.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("not ok: vLLM cannot be imported here (")
    assert "run the check in the engine's image" in err
