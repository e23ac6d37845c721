"""The README's first command, end to end on the CPU: `kvquota demo`."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvquota_lab.demo import ROWS
from kvquota_lab.verdict import Verdict

pytestmark = pytest.mark.engine


def _leftovers(marker: str) -> list[str]:
    """Processes that inherited the demo's environment marker (its whole process tree),
    as `pid: command line`."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                cmdline = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{environ.parent.name}: {cmdline.decode(errors='replace')}")
        except OSError:
            continue
    return found


# Python's multiprocessing resource trackers (the demo's, for its free-tier client, and
# vLLM's) exit on their own once the processes they serve are gone and they read EOF:
# after the demo has returned, by a moment that a busy machine stretches. A process
# still there after this long was left behind.
LEFTOVER_GRACE_SECONDS = 30.0


def _wait_leftovers(marker: str) -> list[str]:
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (found := _leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def _last_screen(stdout: str) -> list[str]:
    """The demo's output from the table's header on."""
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if re.match(r"run +requests +TTFT p50", line)]
    assert header, stdout[-3000:]
    return lines[header[-1]:]


def test_demo_isolates_premium_from_the_burst_and_cleans_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo-run"
    results = tmp_path / "demo.json"
    marker = f"KVQUOTA_DEMO_TEST={uuid.uuid4().hex}"
    proc = subprocess.run(
        [sys.executable, "-m", "kvquota.cli", "demo", "--run-dir", str(run_dir),
         "--json", str(results)],
        capture_output=True, text=True, timeout=600,
        # A newcomer's first run: an empty cache, so the demo generates the tiny model
        # (importing torch and Triton) before it measures.
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1],
             "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KVQuota (policy on)" in proc.stdout and "verdict:" in proc.stdout
    report = json.loads(results.read_text())
    on, stock = report["runs"]["KVQuota (policy on)"], report["runs"]["stock vLLM (FCFS)"]
    verdict = report["verdict"]

    # The last screen is the table, the verdict and where the logs are, with nothing
    # under them: Triton's `nanobind: leaked ...` report on stderr (about 30 lines, at
    # exit, because the demo froze its heap with Triton loaded) once came last.
    verdict_lines = Verdict(**verdict).lines()
    table = 2 + 2 * len(ROWS)  # header, rule, a row per kind of request and run
    screen = _last_screen(proc.stdout)
    assert screen[table:-1] == ["", *verdict_lines], "\n".join(screen)
    assert re.fullmatch(r"\[ *[0-9.]+s\] done; logs in .+", screen[-1]), screen[-1]
    assert [line for line in proc.stderr.splitlines() if "nanobind" in line] == [], (
        proc.stderr[-3000:])

    # Every premium follow-up got an answer in both runs, and p99 rests on 30 of them.
    for run in (on, stock):
        assert run["premium"]["sent"] >= 30
        assert len(run["premium"]["ttfts"]) == run["premium"]["sent"]
    # The problem is reproduced: stock vLLM loses the idle conversations' cache...
    assert stock["premium"]["prefix_hit_rate"] < 0.5
    # ...and KVQuota's leases keep it. A follow-up can only miss its 40 new tokens and
    # the previous turn's last partial block: 320 of the shortest one's 372 tokens are
    # whole cached blocks (86%); 0.8 still holds if one of the 30 loses its lease.
    assert on["premium"]["prefix_hit_rate"] >= 0.8, [
        (r["turn"], r["sent_at"], r["cached_tokens"], r["prompt_tokens"])
        for r in report["requests"]["KVQuota (policy on)"] if r["tier"] == "premium"]
    # Admission holds the free tier back, premium never: refused or queued, not served.
    assert on["premium"]["rejected_quota"] == on["premium"]["rejected_watermark"] == 0
    held_back = (on["free"]["rejected_quota"] + on["free"]["rejected_watermark"]
                 + sum(1 for ms in on["free"]["queue_ms"] if ms > 0))
    assert held_back > 0

    assert _wait_leftovers(marker) == []
    # Order, not speed: on stock each follow-up was served after free requests that
    # had queued before it (34-56 of them, median, measured here; 48 in a CI run too
    # busy for the TTFT verdict); with KVQuota after fewer, in the same run: those the
    # engine was already prefilling, a handful at the free tier's quota (0-9 measured;
    # 160 blocks // 31 per burst request = 5). Busy or not, so it is checked before
    # the verdict may skip.
    stock_ahead = statistics.median(stock["premium"]["served_ahead"])
    assert stock_ahead >= 1
    assert statistics.median(on["premium"]["served_ahead"]) < stock_ahead

    if not verdict["shown"]:
        # A machine too busy to show the effect is said so, by its measure, and no
        # ratio is printed.
        assert verdict["problems"] and verdict["ratio"] is None
        assert "x of stock vLLM" not in proc.stdout
        pytest.skip("the demo could not show the effect here: " + "; ".join(
            verdict["problems"]))
    # The direction of the headline, within one run: premium is faster with KVQuota.
    assert verdict["protected"] and verdict["ratio"] < 1.0, proc.stdout[-3000:]
    assert f"{verdict['ratio']:.2f}x of stock vLLM" in proc.stdout
