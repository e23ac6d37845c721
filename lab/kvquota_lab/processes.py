"""Start, wait for and stop the local processes the demo and the tests run.

Each child gets its own process group so stopping it also stops what it spawned
(vLLM's EngineCore is a child of the API server).
"""

from __future__ import annotations

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


class ProcessFailed(RuntimeError):
    """A managed process exited or never became ready; the message has its log tail."""


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_http(
        self, url: str, timeout: float, *,
        progress: Callable[[float], None] | None = None, every: float = 10.0,
    ) -> None:
        """Poll `url` until it answers 200, the process dies, or `timeout` passes;
        `progress(elapsed)` is called every `every` seconds meanwhile."""
        start = time.monotonic()
        deadline, next_report = start + timeout, start + every
        while time.monotonic() < deadline:
            if progress is not None and time.monotonic() >= next_report:
                progress(time.monotonic() - start)
                next_report += every
            if self._proc is None or self._proc.poll() is not None:
                raise ProcessFailed(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ProcessFailed(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


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
        argv += ["--scheduler-cls", PLUGIN_CLASS]
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
