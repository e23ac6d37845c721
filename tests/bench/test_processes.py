"""The lab's one launcher (`kvquota_lab.processes.ManagedProcess`): process group, log
file, wait for HTTP, stop the group."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvquota_lab.processes import (
    ManagedProcess,
    ProcessFailed,
    cpu_seconds,
    free_port,
    memory_kb,
    with_children,
)

# Starts a grandchild in the same group, writes its pid, then serves HTTP on argv[1].
SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])),
                       http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"


def test_waits_for_http_and_stopping_stops_the_group(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess("server", [sys.executable, "-c", SERVER, str(port)],
                          tmp_path / "logs" / "server.log", cwd=tmp_path).start()
    proc.wait_http(f"http://127.0.0.1:{port}/", 30, interval=0.05)
    child = int(proc.log_tail().split()[1])
    assert proc.pid is not None and _alive(child)
    assert proc.stop() == -signal.SIGTERM
    assert proc.pid is None and proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert proc.stop() == -signal.SIGTERM  # again: nothing to do, same status


def test_an_early_exit_fails_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    proc = ManagedProcess("bad", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                          log)
    with pytest.raises(ProcessFailed, match=r"bad exited early \(status 3\):\nboom"):
        proc.start().wait_http("http://127.0.0.1:9/", 30)
    assert proc.stop() == 3


def test_append_log_keeps_the_earlier_run_and_kill_is_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "op.log"
    log.write_text("earlier run\n")
    proc = ManagedProcess("op", [sys.executable, "-c", "print('again'); import time; "
                                 "time.sleep(600)"], log, append_log=True).start()
    deadline = time.monotonic() + 30
    while "again" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.log_tail().splitlines() == ["earlier run", "again"]
    assert proc.kill() == -signal.SIGKILL


def test_cpu_and_memory_of_a_process_and_its_children(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess("server", [sys.executable, "-c", SERVER, str(port)],
                          tmp_path / "server.log").start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/", 30, interval=0.05)
        assert proc.pid is not None
        child = int(proc.log_tail().split()[1])
        assert with_children(proc.pid) == [proc.pid, child]
        assert memory_kb([proc.pid, child]) > memory_kb([proc.pid]) > 0
        assert memory_kb([proc.pid], "VmHWM") >= memory_kb([proc.pid])
        assert cpu_seconds([proc.pid]) > 0  # the interpreter's start-up at least
    finally:
        proc.stop()
    assert memory_kb([-1]) == 0 and cpu_seconds([-1]) == 0.0  # no such process: 0
