"""The chat prompt's ceiling and count against every verified vLLM's rendering.

The sidecar counts chat prompts with the engine's /tokenize and bounds them, before
that count, by its own rendering (`chat_render`), so both must follow each release:
`test_tokenize_contract` (the /tokenize body renders what the chat request renders) and
`test_chat_render_reference` (the local rendering equals vLLM's renderer) run with the
rest of the suite on the installed vLLM; this runs them again on each release in
`engine_sidecar.plugin.vllm_compat.VERIFIED_VLLM` that has no CPU build, in a subprocess
with that release's pure-Python code first on PYTHONPATH (`prepare.py` unpacks it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prepare import REPO, site_dir, site_releases

TESTS = ["tests/sidecar/test_tokenize_contract.py", "tests/sidecar/test_chat_render_reference.py"]


@pytest.mark.parametrize("version", site_releases())
def test_chat_rendering_tests_pass_on_release(version: str) -> None:
    site = site_dir(version)
    if not (site / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM {version} at {site}: python tests/conformance/prepare.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), str(REPO), str(REPO / "operator"), str(REPO / "lab")]))
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    )
    found, location = probe.stdout.split()
    assert found == version and location.startswith(str(site)), probe.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    tail = "\n".join(run.stdout.splitlines()[-40:])
    assert run.returncode == 0, f"chat rendering on vLLM {version} failed:\n{tail}"
    assert " passed" in tail and "failed" not in tail and "skipped" not in tail, tail
