"""A process that froze its heap with Triton loaded ends on its own last line.

The sidecar, the demo and the admission benchmark load transformers (which imports
Triton) and freeze their startup objects. Each runs here as a real interpreter that
imports Triton, freezes, prints its result and exits; what a user reads is its stdout
and stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

NANOBIND_REPORT = "nanobind: leaked"


def _run(body: str) -> subprocess.CompletedProcess[str]:
    script = "import triton\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)


def test_bare_freeze_with_triton_loaded_reports_leaks_at_exit() -> None:
    """What the fix is for: without it, Triton's bindings report at exit. If this stops
    failing the way it should (a Triton that no longer reports), the test below no
    longer shows anything and can go."""
    proc = _run("""
        import gc
        gc.collect()
        gc.freeze()
        print("verdict: done")
    """)
    assert proc.returncode == 0, proc.stderr
    assert NANOBIND_REPORT in proc.stderr


def test_freeze_startup_objects_ends_without_a_leak_report() -> None:
    proc = _run("""
        from engine_sidecar.gateway.frozen_heap import freeze_startup_objects
        freeze_startup_objects()
        freeze_startup_objects()  # the sidecar may load a tokenizer more than once
        print("verdict: done")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "verdict: done"
    assert proc.stderr == ""


def test_a_real_error_still_reaches_stderr() -> None:
    """Nothing is filtered: a frozen process that fails shows its traceback, whole."""
    proc = _run("""
        from engine_sidecar.gateway.frozen_heap import freeze_startup_objects
        freeze_startup_objects()
        raise RuntimeError("engine failed: KV cache too small")
    """)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: engine failed: KV cache too small"
    assert NANOBIND_REPORT not in proc.stderr
