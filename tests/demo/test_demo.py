"""The README's first command, end to end on the CPU: `kvquota demo`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def _leftovers(marker: str) -> list[int]:
    """Processes that inherited the demo's environment marker (its whole process tree)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_demo_isolates_premium_from_the_burst_and_cleans_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo-run"
    results = tmp_path / "demo.json"
    marker = f"KVQUOTA_DEMO_TEST={uuid.uuid4().hex}"
    proc = subprocess.run(
        [sys.executable, "-m", "kvquota.cli", "demo", "--run-dir", str(run_dir),
         "--json", str(results)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT p99" in proc.stdout and "KVQuota (policy on)" in proc.stdout
    runs = json.loads(results.read_text())
    on, stock = runs["KVQuota (policy on)"], runs["stock vLLM (FCFS)"]
    # The problem is reproduced: stock vLLM loses the premium conversations' cache...
    assert stock["premium"]["prefix_hit_rate"] < 0.5
    # ...and the policy keeps it, and keeps premium faster under the same burst. How
    # much faster depends on the machine (the demo prints the ratio: 0.15x-0.6x here;
    # 9 premium requests make p99 their slowest one), so only the direction is checked.
    assert on["premium"]["prefix_hit_rate"] >= 0.9
    assert on["premium"]["ttft_p99"] < stock["premium"]["ttft_p99"]
    assert on["premium"]["rejected_quota"] == on["premium"]["rejected_watermark"] == 0
    assert on["free"]["rejected_quota"] + on["free"]["rejected_watermark"] > 0
    assert _leftovers(marker) == []
