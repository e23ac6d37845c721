"""Conformance: vLLM's own `tests/v1/core` suite passes with the plugin in place.

For the first and the newest verified release (`prepare.conformance_releases`), the
release's suite runs twice, once with vLLM's Scheduler and once with
TenantAwareScheduler swapped in (`vllm_swap`), both without a policy; every test that
passes stock must pass with the plugin. A test that fails stock as well is excluded and
counted, never hidden. A release without a CPU build runs from its unpacked Python code
(`prepare.site_dir`), with the CPU as the fallback platform's device (`vllm_swap`).
Needs `python tests/conformance/prepare.py` (`make test` runs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from prepare import HF_HUB_DIR, REPO, conformance_releases, site_dir, suite_dir

pytestmark = pytest.mark.conformance

HERE = Path(__file__).resolve().parent
# Below this share of its tests passing stock, a run is itself broken (no configs, no
# platform): the comparison would be vacuous. Seen here: vLLM 0.32.0 passes about 950
# of 1,030, 0.34.0 about 1,190 of 1,200.
MIN_STOCK_PASS_SHARE = 0.85


def _run_suite(version: str, scheduler: str, junit: Path) -> subprocess.Popen[bytes]:
    site = site_dir(version)
    unpacked = (site / "vllm").is_dir()
    env = dict(
        os.environ,
        KVQUOTA_CONFORMANCE_SCHEDULER=scheduler,
        PYTHONPATH=os.pathsep.join(
            [*([str(site)] if unpacked else []), str(HERE), str(REPO), str(REPO / "operator"),
             str(REPO / "lab")]
        ),
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(HF_HUB_DIR),
        VLLM_CACHE_ROOT=str(suite_dir(version).parent / "vllm-cache"),
        KVQUOTA_CONFORMANCE_NO_PLATFORM="1" if unpacked else "0",
    )
    env.pop("KVQUOTA_POLICY_PATH", None)
    env.pop("KVQUOTA_STATS_PATH", None)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "tests/v1/core", "-p", "vllm_swap", "-q",
         "-p", "no:cacheprovider", f"--junitxml={junit}"],
        cwd=suite_dir(version), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def outcomes(junit: Path) -> dict[str, str]:
    """nodeid-like name -> passed / failed / error / skipped."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            results[name] = "failed"
        elif "error" in kinds:
            results[name] = "error"
        elif "skipped" in kinds:
            results[name] = "skipped"
        else:
            results[name] = "passed"
    return results


@pytest.mark.parametrize("version", conformance_releases())
def test_plugin_passes_every_test_stock_vllm_passes(version: str, tmp_path: Path) -> None:
    if not (suite_dir(version) / "tests" / "v1" / "core").is_dir():
        pytest.skip(f"vLLM {version}'s test suite is not fetched: python "
                    "tests/conformance/prepare.py (make test does)")
    # Both runs at once: each is one process, and the machine has at least two cores.
    runs = {
        name: _run_suite(version, name, tmp_path / f"{name}.xml")
        for name in ("stock", "plugin")
    }
    logs = {name: run.communicate()[0].decode(errors="replace") for name, run in runs.items()}
    results = {}
    for name in runs:
        junit = tmp_path / f"{name}.xml"
        assert junit.is_file(), f"{name} run wrote no results:\n{logs[name][-4000:]}"
        results[name] = outcomes(junit)
    stock, plugin = results["stock"], results["plugin"]
    stock_passed = {test for test, outcome in stock.items() if outcome == "passed"}
    plugin_passed = {test for test, outcome in plugin.items() if outcome == "passed"}
    summary = (
        f"vLLM {version} tests/v1/core: stock passes {len(stock_passed)} of {len(stock)}, "
        f"plugin passes {len(plugin_passed)} of {len(plugin)}; "
        f"{len(set(stock) - stock_passed)} excluded (not passing stock)"
    )
    print(summary)
    excluded = sorted(f"{test} ({stock[test]})" for test in set(stock) - stock_passed)
    (suite_dir(version).parent / f"last-run-{version}.txt").write_text(
        "\n  ".join([summary, *excluded]) + "\n"
    )
    for line in logs["stock"].splitlines():
        if line.startswith(("scheduler:", "   ")):
            print(line)  # the deselected tests and why
    assert set(plugin) == set(stock), "the two runs collected different tests"
    assert len(stock_passed) >= MIN_STOCK_PASS_SHARE * len(stock), (
        summary + "\n" + logs["stock"][-4000:]
    )
    regressions = sorted(stock_passed - plugin_passed)
    assert not regressions, (
        f"{summary}\npass stock, not with the plugin:\n  " + "\n  ".join(regressions)
        + "\n" + logs["plugin"][-6000:]
    )
