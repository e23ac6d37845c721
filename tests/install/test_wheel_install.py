"""`pip install 'kvquota[operator,sidecar]'` as a user gets it: the built wheel in a
fresh venv that sees only the wheel's declared runtime dependencies with those two
extras (`support.fresh_install`), none of the others; and the bare `pip install kvquota`.

The shared test environment has every extra installed, so a missing-extra message can
only be proved here, where vLLM, matplotlib and the test tools really are absent (the
first test checks that, so the others cannot pass for the wrong reason).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support.fresh_install import build_wheel, clean_env, fresh_venv

import kvquota

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    workdir = tmp_path_factory.mktemp("wheel")
    bin_dir = fresh_venv(workdir, build_wheel(workdir), extras=("operator", "sidecar"))
    home = workdir / "home"
    home.mkdir()
    return bin_dir, clean_env(home)


@pytest.fixture
def run(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> Run:
    bin_dir, env = installed

    def run(program: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / program), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    return run


def _installed_samples(run: Run) -> Path:
    out = run("python", "-c", "import kvquota.paths as p; print(p.samples())")
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def test_the_venv_sees_the_runtime_dependencies_and_no_extra(run: Run) -> None:
    out = run("python", "-c", "import kvquota, kopf, celpy, jwt; print(kvquota.__file__)")
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout  # the wheel, not the checkout
    for extra_module in ("vllm", "torch", "matplotlib", "transformers", "pytest", "kmock",
                         "opentelemetry.sdk"):
        missing = run("python", "-c", f"import {extra_module}")
        assert missing.returncode != 0, f"{extra_module} is visible in the fresh venv"
    check = run("python", "-m", "pip", "--version")
    assert check.returncode != 0  # no pip either: nothing can have been installed later


def test_version(run: Run) -> None:
    out = run("kvquota", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvquota {kvquota.__version__} (API kvquota.dev/v1alpha1)"
    meta = run("python", "-c", "import importlib.metadata as m; print(m.version('kvquota'))")
    assert meta.stdout.strip() == kvquota.__version__


def test_local_mode_renders_the_shipped_samples(run: Run, tmp_path: Path) -> None:
    samples = _installed_samples(run)
    assert "site-packages" in str(samples)
    out = run("kvquota", "operator", "--local", str(samples), "--once", "--out", "rendered")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert (tmp_path / "rendered" / "policies" / "default.demo-pool.json").is_file()
    assert "TenantQuota default/acme: Accepted=True" in out.stdout


def test_local_mode_evaluates_cel_rules_without_the_test_extra(run: Run, tmp_path: Path) -> None:
    """The watermark bound is a CEL rule only: refused here means CEL ran."""
    repo = tmp_path / "repo"
    repo.mkdir()
    pool = yaml.safe_load((_installed_samples(run) / "inferencepool.yaml").read_text())
    pool["spec"]["kvCache"]["watermark"] = 0.7
    (repo / "pool.yaml").write_text(yaml.safe_dump(pool))
    out = run("kvquota", "operator", "--local", str(repo), "--once", "--out", "rendered")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "kvCache.watermark must be >= 0 and < 0.5" in out.stderr
    assert "0.7" in out.stderr


@pytest.mark.parametrize(("command", "extra"), [
    (("demo",), "engine"),
    (("bench",), "engine"),
    (("bench", "suite"), "engine"),
    (("bench", "--backend", "engine"), "engine"),
    (("tiny-model", "--out", "model"), "engine"),
])
def test_commands_without_their_extra_say_which_to_install(
    run: Run, command: tuple[str, ...], extra: str
) -> None:
    out = run("kvquota", *command)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"pip install 'kvquota[{extra}]'" in out.stderr


def test_bench_list_needs_no_extra(run: Run) -> None:
    out = run("kvquota", "bench", "list")
    assert out.returncode == 0, out.stderr
    assert "noisy-neighbour" in out.stdout  # scenarios found as package data


def test_plot_without_matplotlib_names_the_lab_extra(run: Run) -> None:
    out = run("python", "-c", "from kvquota.extras import require; "
              "require('kvquota bench --plot', 'matplotlib')")
    assert "pip install 'kvquota[lab]'" in out.stderr


def test_the_sidecar_starts_its_cli_without_extras(run: Run) -> None:
    out = run("kvquota", "sidecar", "--help")
    assert out.returncode == 0, out.stderr


def test_a_bare_install_names_the_extra_each_command_needs(tmp_path: Path) -> None:
    """`pip install kvquota` holds the contract and `kvquota crds`; the operator's and
    the sidecar's dependencies come with their extras, and each command says which."""
    bin_dir = fresh_venv(tmp_path, build_wheel(tmp_path))
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / "kvquota"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    crds = run("crds", "--out", "crds")  # no extra needed
    assert crds.returncode == 0, crds.stderr
    assert len(list((tmp_path / "crds").glob("*.yaml"))) >= 2
    for command, extra in ((("operator", "--all-namespaces"), "operator"),
                           (("sidecar", "--policy-file", "p.json"), "sidecar")):
        out = run(*command)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        assert f"pip install 'kvquota[{extra}]'" in out.stderr
