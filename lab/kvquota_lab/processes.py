"""Start, wait for and stop the local processes the demo, the benches, the perf
harnesses and the tests run: `ManagedProcess` is the lab's one launcher.

Each child gets its own process group so stopping it also stops what it spawned
(vLLM's EngineCore is a child of the API server), and writes stdout and stderr to a
log file whose tail goes into every failure message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine_sidecar.contract.names import PLUGIN_CLASS, POLICY_PATH_ENV, STATS_PATH_ENV


def free_port() -> int:
    """A port nobody listens on now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def with_children(pid: int) -> list[int]:
    """`pid` and its direct children (e.g. the sidecar's tokenizer workers), from /proc."""
    pids = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU the processes have used so far (the kernel's count in /proc);
    a process that is gone counts 0."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def memory_kb(pids: list[int], field_name: str = "VmRSS") -> int:
    """A /proc status memory figure summed over the processes, in kB: `VmRSS` resident
    now, `VmHWM` its peak; a process that is gone counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(f"{field_name}:"):
                    total += int(line.split()[1])
    return total


class ProcessFailed(RuntimeError):
    """A managed process exited or never became ready; the message has its log tail."""


@dataclass
class ManagedProcess:
    """`argv` in a process group of its own, stdout and stderr to `log_path` (appended
    to with `append_log`), `env` over this process's environment, run in `cwd`."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    append_log: bool = False
    returncode: int | None = None  # once stopped (or killed): its exit status
    _proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if self.append_log else "wb") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
            )
        self.returncode = None
        return self

    @property
    def pid(self) -> int | None:
        """While started and not stopped (None before and after)."""
        return self._proc.pid if self._proc else None

    def poll(self) -> int | None:
        """The exit status if the process has exited (None: running or not started)."""
        return self._proc.poll() if self._proc else self.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_http(
        self, url: str, timeout: float, *,
        progress: Callable[[float], None] | None = None, every: float = 10.0,
        interval: float = 0.25, any_status: bool = False,
    ) -> None:
        """Poll `url` every `interval` seconds until it answers 200 (any HTTP answer
        with `any_status`), the process dies, or `timeout` passes; `progress(elapsed)`
        is called every `every` seconds meanwhile. From an event loop that serves what
        the process needs, run it in a thread (`asyncio.to_thread`)."""
        start = time.monotonic()
        deadline, next_report = start + timeout, start + every
        while time.monotonic() < deadline:
            if progress is not None and time.monotonic() >= next_report:
                progress(time.monotonic() - start)
                next_report += every
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc else None
                raise ProcessFailed(f"{self.name} exited early (status {code}):\n"
                                    f"{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200 or any_status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval)
        raise ProcessFailed(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to the group, SIGKILL after `grace` seconds; returns the exit status
        (None: never started, or did not exit even then)."""
        return self._signal((signal.SIGTERM, grace), (signal.SIGKILL, 5.0))

    def kill(self, wait: float = 30.0) -> int | None:
        """SIGKILL to the group at once, like a node failure: no clean exit."""
        return self._signal((signal.SIGKILL, wait))

    def _signal(self, *steps: tuple[signal.Signals, float]) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return self.returncode
        for sig, wait in steps:
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
        self.returncode = proc.poll()
        return self.returncode


@dataclass
class EngineOptions:
    model: Path
    port: int
    policy_path: Path
    stats_path: Path
    plugin: bool = True
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only
    kv_cache_bytes: int = 16 * 1024 * 1024
    max_model_len: int = 2048
    max_num_seqs: int = 64
    # > 0: vLLM's OffloadingConnector with a host tier of this many bytes (kvquota_lab.cpu_offload)
    kv_offload_bytes: int = 0
    log_stats: bool = False  # True: keep vLLM's stats, incl. the Prometheus /metrics counters
    # --scheduler-cls with the plugin: another path of it (an older release's) to test it
    plugin_class: str = PLUGIN_CLASS
    extra_args: list[str] = field(default_factory=list)


def vllm_engine(opts: EngineOptions, log_path: Path) -> ManagedProcess:
    """vLLM's OpenAI server on the CPU backend, with the KVQuota plugin unless disabled."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(opts.model),
        "--host", "127.0.0.1",
        "--port", str(opts.port),
        "--max-model-len", str(opts.max_model_len),
        "--max-num-seqs", str(opts.max_num_seqs),
        "--block-size", str(opts.block_size),
        "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
        "--enable-prefix-caching",
        *([] if opts.log_stats else ["--disable-log-stats"]),
        "--scheduling-policy", "priority" if opts.plugin else "fcfs",
        *opts.extra_args,
    ]
    if opts.plugin:
        argv += ["--scheduler-cls", opts.plugin_class]
    if opts.kv_offload_bytes > 0:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "CPUEngineOffloadingSpec",
                "spec_module_path": "kvquota_lab.cpu_offload",
                "cpu_bytes_to_use": opts.kv_offload_bytes,
            },
        })]
    env = {
        POLICY_PATH_ENV: str(opts.policy_path),
        STATS_PATH_ENV: str(opts.stats_path),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return ManagedProcess("vllm", argv, log_path, env)
