"""The cluster suite (tests/cluster) stays out of the way without a cluster: unless
KVQUOTA_CLUSTER_TESTS=1, each of its tests skips with one reason that says how to run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cluster_suite_skips_with_its_reason_without_the_variable() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVQUOTA_CLUSTER_TESTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/cluster", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "passed" not in out and "failed" not in out, out
    assert "set KVQUOTA_CLUSTER_TESTS=1 to run it against the cluster in KUBECONFIG" in out, out
