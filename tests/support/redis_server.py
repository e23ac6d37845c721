"""A real redis-server the tests start on a free port (Debian's `redis-server`;
`make test` installs it). No persistence: a restart comes back empty, the worst case."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port(bus: bool = False) -> int:
    """A free port; `bus`: one whose cluster bus port (+10000) is a free port too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisServer:
    def __init__(self, workdir: Path, password: str | None = None,
                 cluster: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not found: `apt-get install -y redis-server` "
                        "(make test does it as root)")
        pytest.importorskip("redis", reason="the redis client: pip install 'kvquota[sidecar]'")
        self.binary = binary
        self.port = _free_port(bus=cluster)
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = password
        # A one-node Redis Cluster owning every slot: a script that touches keys of two
        # slots, or a command on keys of two slots, is refused as on a real cluster.
        self.cluster = cluster

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir),
             *(["--requirepass", self.password] if self.password else []),
             *(["--cluster-enabled", "yes", "--cluster-config-file",
                str(self.workdir / f"nodes-{self.port}.conf")] if self.cluster else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not start within 10 s")
        if self.cluster:
            self._own_every_slot(deadline)

    def _own_every_slot(self, deadline: float) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            with contextlib.suppress(redis.ResponseError):  # a restart keeps its slots
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        while time.monotonic() < deadline:
            if b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"):
                return
            time.sleep(0.02)
        raise RuntimeError("the one-node cluster did not come up within 10 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None
