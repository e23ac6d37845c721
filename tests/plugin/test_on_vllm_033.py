"""The scheduler-level plugin tests (real Scheduler, no model) on vLLM 0.33 too.

vLLM 0.33.0 has no CPU build, but its scheduler is pure Python and runs beside this
torch: `python tests/conformance/prepare.py vllm-0.33` (run by `make test`) unpacks the
wheel into `.cache/vllm-0.33/site`; this test then runs every non-engine test in
tests/plugin in a subprocess with that directory first on PYTHONPATH. Without the
directory it skips (set KVQUOTA_VLLM_033_SITE to use another one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SITE_ENV = "KVQUOTA_VLLM_033_SITE"
# Set in the subprocess: it must not start itself again.
_NESTED_ENV = "KVQUOTA_ON_VLLM_033"


def _site() -> Path:
    return Path(os.environ.get(SITE_ENV) or REPO / ".cache" / "vllm-0.33" / "site")


@pytest.mark.skipif(os.environ.get(_NESTED_ENV) == "1", reason="already on vLLM 0.33")
def test_plugin_scheduler_tests_pass_on_vllm_033() -> None:
    site = _site()
    if not (site / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM 0.33 at {site}: python tests/conformance/prepare.py vllm-0.33")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), str(REPO), str(REPO / "operator")]),
        **{_NESTED_ENV: "1"},
    )
    env.pop("KVQUOTA_ALLOW_UNSUPPORTED_VLLM", None)  # 0.33 must pass the version gate
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    )
    version, location = probe.stdout.split()
    assert version == "0.33.0" and location.startswith(str(site)), probe.stdout
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/plugin", "-m", "not engine", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    tail = "\n".join(run.stdout.splitlines()[-40:])
    assert run.returncode == 0, f"tests/plugin on vLLM 0.33.0 failed:\n{tail}\n{run.stderr[-2000:]}"
    assert " passed" in tail and "failed" not in tail, tail
    print(f"tests/plugin on vLLM 0.33.0: {tail.splitlines()[-1]}")
