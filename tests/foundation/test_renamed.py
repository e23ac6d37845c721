"""0.1.0's module paths still work after the layout move, each warning once with the
name to use and the release it goes away in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvquota
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.renamed import RENAMED, Renamed

REPO = Path(__file__).resolve().parents[2]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_old_policy_module_is_the_contract_and_warns_once() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        # Imported by name, as vLLM resolves a class path (a script's own `import` would
        # also show the DeprecationWarning, which Python filters elsewhere).
        [sys.executable, "-c", "import importlib; p = importlib.import_module("
         "'engine_sidecar.policy'); importlib.import_module('engine_sidecar.policy'); "
         "from engine_sidecar.policy import EnginePolicy, write_atomically, API_VERSION; "
         "print(p.EnginePolicy.__module__)"],
        env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == EnginePolicy.__module__
    (line,) = run.stderr.splitlines()  # the log line; the DeprecationWarning is filtered
    assert line == ("kvquota: engine_sidecar.policy is deprecated since kvquota 0.2.0 and "
                    "goes away in 0.4.0; use engine_sidecar.contract.policy (`kvquota inject "
                    "--upgrade` rewrites manifests injected by an older release)")


def test_code_that_tests_its_imports_sees_a_deprecation_warning() -> None:
    sys.modules.pop("engine_sidecar.policy", None)
    with pytest.warns(DeprecationWarning, match="use engine_sidecar.contract.policy"):
        import engine_sidecar.policy  # noqa: F401


@pytest.mark.parametrize("renamed", RENAMED, ids=lambda r: r.old)
def test_every_renamed_name_still_goes_away_in_a_later_release(renamed: Renamed) -> None:
    """When the release named comes, its alias, its entry and its frozen name go."""
    assert _release(renamed.since) <= _release(kvquota.__version__)
    assert _release(renamed.removed_in) > _release(kvquota.__version__)
