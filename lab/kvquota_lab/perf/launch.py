"""The perf harnesses' processes: a run's working directory, and the sidecar, stub and
vLLM engine started in it (each its own process, optionally pinned to a CPU).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_sidecar.contract.names import PAUSE_PROBE_ENV
from kvquota_lab.processes import ManagedProcess, ProcessFailed, free_port, with_children
from kvquota_lab.stack import Processes


@dataclass
class Setup:
    """A run's working directory and the processes started in it (logs there too)."""

    workdir: Path
    procs: Processes = field(default_factory=Processes)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None, *, ready: str | None = None,
              timeout: float = 60.0) -> ManagedProcess:
        """Start `argv` (log: `name`.log); with `ready`, wait until that URL answers 200
        (exits the harness with the log's tail if the process dies or stays unready)."""
        proc = self.procs.start(ManagedProcess(name, argv, self.workdir / f"{name}.log",
                                               env or {}, cwd=cwd))
        if ready is not None:
            try:
                proc.wait_http(ready, timeout)
            except ProcessFailed as exc:
                raise SystemExit(str(exc)) from None
        return proc

    def close(self) -> None:
        self.procs.stop_all()


BENCH_TENANT: dict[str, Any] = {
    "tier": "premium", "priority": 0, "guaranteed_blocks": 1_000_000,
    "max_blocks_per_engine": 1_000_000, "max_tokens": 4096, "default_max_tokens": 16,
}


def write_policy(workdir: Path, model: str, tenants: dict[str, dict[str, Any]] | None = None
                  ) -> tuple[Path, Path, dict[str, str]]:
    """Policy file, secrets dir and a JWT per tenant (default: one premium "bench")."""
    import jwt

    from engine_sidecar.contract.policy import EnginePolicy

    tenants = tenants or {"bench": BENCH_TENANT}
    secrets_dir = workdir / "secrets"
    secrets_dir.mkdir()
    hs_secret = secrets.token_bytes(32)  # generated per run, never stored in code
    (secrets_dir / "jwt-hs").write_bytes(hs_secret)
    (secrets_dir / "cache-salt").write_bytes(secrets.token_bytes(32))
    policy = EnginePolicy.model_validate({
        "pool": "bench/pool", "model": model, "block_size": 32, "watermark": 0.1,
        "auth": {"jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"],
                         "audience": "bench", "issuer": "bench"}},
        "tenants": {name: {"tenant_id": name, **fields} for name, fields in tenants.items()},
    }).with_version()
    policy_file = workdir / "policy.json"
    policy_file.write_text(policy.to_json())
    tokens = {name: jwt.encode({"tenant_id": name, "aud": "bench", "iss": "bench",
                                "exp": int(time.time()) + 86_400}, hs_secret, algorithm="HS256")
              for name in tenants}
    return policy_file, secrets_dir, tokens


def start_sidecar(setup: Setup, upstream: str, model: str, tokenizer: str | None,
                   tenants: dict[str, dict[str, Any]] | None = None,
                   code: Path | None = None, cpu: str | None = None,
                   extra: list[str] | None = None, admin_port: int | None = None,
                   pause_probe: Path | None = None
                   ) -> tuple[str, dict[str, str], ManagedProcess]:
    """A `kvquota sidecar` process; `code`: run the sidecar of another source tree
    (e.g. `git archive` of an older commit); `admin_port`: where its /metrics and
    status listen (default: any free port); `pause_probe`: the file its loop-lag and GC
    probe writes (`telemetry.pause_probe`; a sidecar without the probe ignores it)."""
    port = free_port()
    home = setup.workdir / f"sidecar-{port}"
    home.mkdir()
    policy_file, secrets_dir, tokens = write_policy(home, model, tenants)
    argv = [*pinned(cpu), sys.executable, "-m", "engine_sidecar.cli", "sidecar",
            "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin_port or free_port()}",
            "--upstream", upstream,
            "--policy-file", str(policy_file), "--secrets-dir", str(secrets_dir),
            "--log-level", "warning"]
    argv += ["--tokenizer", tokenizer] if tokenizer else ["--engine-tokenizer"]
    argv += extra or []
    env = {"PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])
           } if code else {}
    if pause_probe is not None:
        env[PAUSE_PROBE_ENV] = str(pause_probe)
    proc = setup.start(f"sidecar-{port}", argv, env, cwd=code,  # `-m`: cwd first
                       ready=f"http://127.0.0.1:{port}/readyz", timeout=180)
    return f"http://127.0.0.1:{port}", tokens, proc


def move_children(pid: int, cpu: str) -> None:
    """Put the sidecar's child processes (its tokenizer workers) on `cpu`: the event
    loop keeps its core, the counting gets another (more than one core)."""
    for child in with_children(pid)[1:]:
        os.sched_setaffinity(child, {int(c) for c in cpu.split(",")})


def pinned(cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu] if cpu is not None else []


def start_stub(setup: Setup, args: argparse.Namespace) -> str:
    port = free_port()
    argv = [*pinned(getattr(args, "others_cpu", None)), sys.executable, "-m",
            "kvquota_lab.perf.sidecar", "serve-stub",
            "--port", str(port), "--ttft-ms", str(args.stub_ttft_ms),
            "--chunks", str(args.stub_chunks), "--interval-ms", str(args.stub_interval_ms),
            "--jitter", str(args.stub_jitter),
            "--max-model-len", str(getattr(args, "stub_max_model_len", 4096))]
    if getattr(args, "stub_tokenizer", None):
        argv += ["--tokenizer", args.stub_tokenizer]
        if getattr(args, "stub_tokenize", "live") == "memo":
            argv.append("--memo")
    setup.start("stub", argv, ready=f"http://127.0.0.1:{port}/health", timeout=60)
    return f"http://127.0.0.1:{port}"


def start_engine(setup: Setup, model: str) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--block-size", "32", "--disable-log-stats", "--enable-prefix-caching"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    setup.start("vllm", argv, env, ready=f"http://127.0.0.1:{port}/health", timeout=600)
    return f"http://127.0.0.1:{port}"
