"""The local stack the demo and the engine benchmark run: vLLM (CPU), the sidecar.

Every process is started through `Processes`, which stops them all (newest first)
whatever happens; `terminate_as_interrupt` turns SIGTERM into the same clean stop as
Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvquota.paths import user_cache
from kvquota_lab.processes import EngineOptions, ManagedProcess, free_port, vllm_engine


def tiny_model() -> Path:
    """The tiny model, generated once into the user's cache (`kvquota.paths`)."""
    from kvquota_lab.tinymodel import generate

    return generate(user_cache() / "tiny-model")


class Processes:
    """Everything started here, stopped in reverse order whatever happens."""

    def __init__(self) -> None:
        self._running: list[ManagedProcess] = []

    def start(self, proc: ManagedProcess) -> ManagedProcess:
        self._running.append(proc.start())
        return proc

    def stop(self, proc: ManagedProcess) -> None:
        proc.stop()
        if proc in self._running:
            self._running.remove(proc)

    def stop_all(self) -> None:
        while self._running:
            self._running.pop().stop()


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_for_file(pattern: Callable[[], list[Path]], proc: ManagedProcess, timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern()
        if found:
            return found[0]
        if proc.pid is None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} wrote no policy in {timeout:.0f}s:\n{proc.log_tail()}")


def engine_process(
    model: Path, run: Path, name: str, *, plugin: bool, kv_cache_bytes: int,
    extra_args: list[str] | None = None, block_size: int = 32, max_model_len: int = 2048,
    max_num_seqs: int = 64, log_stats: bool = False,
) -> tuple[ManagedProcess, str]:
    """vLLM's OpenAI server (CPU) with policy/stats files under `run/engine`; not started."""
    opts = EngineOptions(
        model=model, port=free_port(), policy_path=run / "engine" / "policy.json",
        stats_path=run / "engine" / "stats.json", plugin=plugin, block_size=block_size,
        kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, log_stats=log_stats, extra_args=list(extra_args or []),
    )
    return vllm_engine(opts, run / f"{name}.log"), f"http://127.0.0.1:{opts.port}"


def sidecar_process(
    engine_env: dict[str, str], engine_url: str, run: Path, *, policy_file: Path,
    secrets_dir: Path, tokenizer: Path, extra_args: list[str] | None = None,
    admin_port: int | None = None,
) -> tuple[ManagedProcess, str]:
    """The sidecar in front of the engine at `engine_url`; `engine_env` carries the
    engine's policy and stats paths (the sidecar writes the one, reads the other).
    Returns its client URL; its status and metrics are on `admin_port` (a free one if
    not given). Not started."""
    port = free_port()
    proc = ManagedProcess(
        "sidecar",
        [sys.executable, "-m", "kvquota.cli", "sidecar", "--listen", f"127.0.0.1:{port}",
         "--admin-listen", f"127.0.0.1:{admin_port or free_port()}",
         "--upstream", engine_url, "--policy-file", str(policy_file),
         "--secrets-dir", str(secrets_dir), "--tokenizer", str(tokenizer),
         *(extra_args or [])],
        run / "sidecar.log", dict(engine_env),
    )
    return proc, f"http://127.0.0.1:{port}"
