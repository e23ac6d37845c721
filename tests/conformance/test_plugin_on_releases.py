"""The plugin's scheduler-level tests (real Scheduler, no model) on every verified vLLM.

`tests/plugin` runs on the installed vLLM (the CPU build, the first verified release)
with the rest of the suite; this runs it again on each release in
`engine_sidecar.plugin.vllm_compat.VERIFIED_VLLM` that has no CPU build, in a subprocess with
that release's pure-Python code first on PYTHONPATH (`prepare.py` unpacks it; `make test`
runs that). The version gate stays on: each release must pass it as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prepare import REPO, site_dir, site_releases


@pytest.mark.parametrize("version", site_releases())
def test_plugin_scheduler_tests_pass_on_release(version: str) -> None:
    site = site_dir(version)
    if not (site / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM {version} at {site}: python tests/conformance/prepare.py")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(site), str(REPO), str(REPO / "operator"), str(REPO / "lab")]),
    )
    env.pop("KVQUOTA_ALLOW_UNSUPPORTED_VLLM", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    )
    found, location = probe.stdout.split()
    assert found == version and location.startswith(str(site)), probe.stdout
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/plugin", "-m", "not engine", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    tail = "\n".join(run.stdout.splitlines()[-40:])
    assert run.returncode == 0, (
        f"tests/plugin on vLLM {version} failed:\n{tail}\n{run.stderr[-2000:]}"
    )
    assert " passed" in tail and "failed" not in tail, tail
    print(f"tests/plugin on vLLM {version}: {tail.splitlines()[-1]}")
