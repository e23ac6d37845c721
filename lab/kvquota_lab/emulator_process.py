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
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from kvquota_lab.processes import free_port


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
    `--priority 100`); `identity` is its peering identity (a pod's name: POD_ID)."""

    api_url: str
    workdir: Path
    identity: str = "kvquota-operator-0"
    args: Sequence[str] = ()
    liveness_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.identity}.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "kvquota.cli", "operator", "--all-namespaces",
            "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics", f"127.0.0.1:{self.metrics_port}", *self.args,
        ]

    async def start(self, timeout: float = 60.0) -> None:
        """Start, and return once kopf's liveness endpoint answers (kopf serves it
        after its startup handlers, ours included, have run)."""
        kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.api_url)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_ID": self.identity}
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(self.command(), env=env, stdout=log,
                                          stderr=subprocess.STDOUT)
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self._proc.returncode}:\n"
                                   + self.log_tail())
            try:
                await self.liveness()
                return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the operator did not become live in {timeout}s:\n"
                           + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

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
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL, like a node failure: no clean exit, no goodbye to its peers."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=30)

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, like a deleted pod, then wait for the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self._proc.wait, timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self._proc.returncode
