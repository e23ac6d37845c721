"""`kvquota operator` in a process of its own, against the KMock emulator.

For the operator tests and `python -m kvquota_lab.bench_operator` (needs the `test` extra).
Unlike `emulator.OperatorRunner` (kopf in a thread of the test process), this runs the
real command line as a Deployment does: its own interpreter, a kubeconfig naming the
emulator's URL, the liveness and metrics endpoints on ports of its own. A test can kill
it without warning (a crashed pod), measure its memory, and run two with kopf peering
without their metrics or kopf state mixing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from kvquota_lab.processes import ManagedProcess, cpu_seconds, free_port, memory_kb


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for a plain-HTTP API server without credentials (the emulator)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "anonymous", "user": {}}],
        "contexts": [{"name": "emulator",
                      "context": {"cluster": "emulator", "user": "anonymous"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class OperatorProcess:
    """One operator process. `args` are extra `kvquota operator` flags (e.g.
    `--priority 100`); `identity` is its peering identity (a pod's name: POD_ID);
    `namespaces` are watched with `--namespace` (none: `--all-namespaces`)."""

    api_url: str
    workdir: Path
    identity: str = "kvquota-operator-0"
    args: Sequence[str] = ()
    namespaces: Sequence[str] = ()
    liveness_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    _process: ManagedProcess | None = None

    @property
    def pid(self) -> int:
        pid = self._process.pid if self._process else None
        assert pid is not None, "not running"
        return pid

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.identity}.log"

    def command(self) -> list[str]:
        scope = [f"--namespace={ns}" for ns in self.namespaces] or ["--all-namespaces"]
        return [
            sys.executable, "-m", "kvquota.cli", "operator", *scope,
            "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics", f"127.0.0.1:{self.metrics_port}", *self.args,
        ]

    def environment(self) -> dict[str, str]:
        """What the process runs with beside the inherited environment."""
        kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.api_url)
        return {"KUBECONFIG": str(kubeconfig), "POD_ID": self.identity}

    async def start(self, timeout: float = 60.0) -> None:
        """Start, and return once kopf's liveness endpoint answers (kopf serves it
        after its startup handlers, ours included, have run)."""
        env = self.environment()
        # Appended to: a restarted operator (same identity) keeps its earlier log.
        self._process = ManagedProcess(self.identity, self.command(), self.log_path, env,
                                       append_log=True).start()
        # In a thread: the emulator the operator talks to may serve from this loop.
        await asyncio.to_thread(
            self._process.wait_http, f"http://127.0.0.1:{self.liveness_port}/healthz",
            timeout, interval=0.1, any_status=True)

    def log_tail(self, lines: int = 30) -> str:
        tail = self._process.log_tail(lines) if self._process else ""
        return tail or "(no log)"

    async def _get(self, port: int, path: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(
            f"http://127.0.0.1:{port}{path}"
        ) as response:
            return response.status, await response.text()

    async def liveness(self) -> tuple[int, str]:
        """kopf's liveness endpoint: (HTTP status, body)."""
        return await self._get(self.liveness_port, "/healthz")

    async def metrics(self) -> str:
        """The Prometheus exposition text of `/metrics`."""
        status, text = await self._get(self.metrics_port, "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return text

    def rss_bytes(self) -> int:
        """Resident memory of the process now (Linux /proc)."""
        resident = memory_kb([self.pid])
        if not resident:
            raise RuntimeError("no VmRSS in /proc status")
        return resident * 1024

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process has used so far (Linux /proc)."""
        return cpu_seconds([self.pid])

    def kill(self) -> None:
        """SIGKILL, like a node failure: no clean exit, no goodbye to its peers."""
        if self._process is not None:
            self._process.kill()

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, like a deleted pod, then wait for the exit code (SIGKILL after
        `timeout`)."""
        if self._process is None:
            return None
        return await asyncio.to_thread(self._process.stop, timeout)
