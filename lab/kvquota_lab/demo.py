"""`kvquota demo`: the whole product on one machine, noisy neighbour with policy on and off.

1. generates the tiny model; copies `manifests/samples/` into a run directory;
2. runs the operator in local mode on it (policy JSON + status files);
3. starts vLLM's CPU server with the TenantAwareScheduler plugin and the sidecar in
   front of it, and drives the workload (`kvquota_lab.workload`) through the sidecar with
   real JWTs;
4. restarts vLLM stock (FCFS, no plugin, no sidecar) and drives the same workload;
5. prints TTFT p50/p99, refusals and prefix-hit rate per kind of request for both runs,
   and a verdict (`kvquota_lab.verdict`): what was protected and by which mechanism, or
   which measure shows that this machine could not show it.
The workload waits on the engines' own telemetry (`kvquota_lab.engine_state`), not on the
clock, so it means the same on an idle and on a busy machine. Every process it starts
is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from engine_sidecar.contract.names import STATS_PATH_ENV
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.gateway.frozen_heap import freeze_startup_objects
from kvquota.extras import require
from kvquota.paths import copy_samples, user_cache
from kvquota_lab.engine_state import QuotaGauge, StockGauge
from kvquota_lab.loadgen import NoisyNeighbour, Result
from kvquota_lab.processes import ManagedProcess, free_port
from kvquota_lab.stack import (
    Processes,
    engine_process,
    sidecar_process,
    terminate_as_interrupt,
    tiny_model,
    wait_for_file,
)
from kvquota_lab.stream_client import Target
from kvquota_lab.summary import FREE, PREMIUM, PREMIUM_FIRST, TierSummary, summarise
from kvquota_lab.verdict import POLICY_RUN, STOCK_RUN, Verdict, judge
from kvquota_lab.workload import run_noisy_neighbour

KV_CACHE_BYTES = 10 * 1024 * 1024  # 640 blocks of 32 tokens: the samples' capacityBlocks
ENGINE_START_TIMEOUT = 300.0


class _Progress:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", flush=True)


@dataclass(frozen=True)
class Auth:
    """A demo identity provider: an RSA key pair; the sidecar only sees the public key."""

    private_pem: bytes
    issuer: str | None
    audience: str | None
    claim: str

    def token(self, tenant: str) -> str:
        import jwt

        now = int(time.time())
        claims: dict[str, Any] = {self.claim: tenant, "iat": now, "exp": now + 3600}
        if self.issuer:
            claims["iss"] = self.issuer
        if self.audience:
            claims["aud"] = self.audience
        return jwt.encode(claims, self.private_pem, algorithm="RS256")


def _prepare(run: Path) -> tuple[Path, Path, Auth]:
    """Copy the samples and write the pool's Secret files (generated, never committed)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    manifests, secrets_dir = run / "manifests", run / "secrets"
    shutil.rmtree(run, ignore_errors=True)
    copy_samples(manifests, skip=("kustomization.yaml",))
    pool = next(
        doc for path in sorted(manifests.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "InferencePool"
    )
    jwt_spec = pool["spec"]["auth"]["jwt"]
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    secrets_dir.mkdir(parents=True)
    (secrets_dir / jwt_spec["secretRef"]["key"]).write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ))
    (secrets_dir / "cache-salt").write_text(secrets.token_hex(32))
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    auth = Auth(private_pem, jwt_spec.get("issuer"), jwt_spec.get("audience"),
                jwt_spec.get("tenantClaim", "tenant_id"))
    return manifests, secrets_dir, auth


# Both engines, policy on and off:
# - log stats: the workload reads vLLM's /metrics;
# - eager mode: torch.compile adds 10-40 s per engine start on 2 cores and does not make
#   this tiny model faster;
# - stream interval: the first token still goes out at once (TTFT is unchanged), later
#   ones in chunks of 16. One chunk per token costs the API server, the sidecar and the
#   client more CPU than the tiny model's decoding, and on a busy machine that CPU is
#   what premium requests wait for.
ENGINE_ARGS = ["--enable-prompt-tokens-details", "--enforce-eager", "--stream-interval", "16"]


def _engine(model: Path, run: Path, name: str, plugin: bool,
            served_model_name: str | None = None) -> tuple[ManagedProcess, str]:
    """`served_model_name`: the pool's spec.model, as injection starts vLLM, so answers
    name the model the client asked for, not the model's directory."""
    served = ["--served-model-name", served_model_name] if served_model_name else []
    return engine_process(model, run, name, plugin=plugin, kv_cache_bytes=KV_CACHE_BYTES,
                          log_stats=True, extra_args=[*ENGINE_ARGS, *served])


def _start_engine(procs: Processes, engine: ManagedProcess, url: str, say: _Progress) -> None:
    procs.start(engine).wait_http(
        url + "/health", ENGINE_START_TIMEOUT, progress=lambda elapsed: say(
            f"  ... vLLM still starting ({elapsed:.0f}s; it imports torch and vLLM in three "
            f"processes; log: {engine.log_path})"),
    )


def operator_output(run: Path) -> tuple[Path, list[str]]:
    """Where local mode writes its EnginePolicy files (`OUT/policies/`), and the flags
    that say so: inside the run directory, never inside the manifests it reads."""
    out = run / "local"
    return out / "policies", ["--out", str(out)]


def _run_policy_on(
    procs: Processes, model: Path, run: Path, workload: NoisyNeighbour, say: _Progress
) -> list[Result]:
    manifests, secrets_dir, auth = _prepare(run)
    policies, out_flags = operator_output(run)
    say("operator (local mode) renders manifests/samples into an EnginePolicy")
    operator = procs.start(ManagedProcess(
        "operator",
        [sys.executable, "-m", "kvquota.cli", "operator", "--local", str(manifests), *out_flags],
        run / "operator.log",
    ))
    policy_file = wait_for_file(lambda: sorted(policies.glob("*.json")), operator, 60)
    policy = EnginePolicy.from_json(policy_file.read_text())
    say(f"policy {policy_file.name}; starting vLLM (CPU) with the TenantAwareScheduler plugin")
    engine, engine_url = _engine(model, run, "vllm-policy", plugin=True,
                                 served_model_name=policy.model)
    _start_engine(procs, engine, engine_url, say)
    admin_port = free_port()
    sidecar, sidecar_url = sidecar_process(
        engine.env, engine_url, run, policy_file=policy_file, secrets_dir=secrets_dir,
        tokenizer=model, admin_port=admin_port,
    )
    procs.start(sidecar)
    sidecar.wait_http(sidecar_url + "/readyz", 120)
    say(f"sidecar ready; the workload through it: {_describe(workload)}")
    headers = {tenant: {"Authorization": f"Bearer {auth.token(tenant)}"}
               for tenant in (workload.premium_tenant, workload.free_tenant)}
    target = Target(sidecar_url, policy.model, lambda tenant: headers[tenant])
    gauge = QuotaGauge(engine_url, f"http://127.0.0.1:{admin_port}",
                       Path(engine.env[STATS_PATH_ENV]), policy, workload.free_tenant)
    results = asyncio.run(run_noisy_neighbour(target, workload, gauge, say))
    procs.stop_all()
    return results


def _run_stock(
    procs: Processes, model: Path, run: Path, workload: NoisyNeighbour, say: _Progress
) -> list[Result]:
    say("starting stock vLLM (FCFS, no plugin, no sidecar)")
    engine, engine_url = _engine(model, run, "vllm-stock", plugin=False)
    _start_engine(procs, engine, engine_url, say)
    say("the same workload straight at vLLM")
    results = asyncio.run(run_noisy_neighbour(
        Target(engine_url, str(model)), workload, StockGauge(engine_url), say))
    procs.stop_all()
    return results


def _describe(w: NoisyNeighbour) -> str:
    return (f"{w.premium_sessions} premium conversations x {w.turns} turns; before each "
            f"follow-up turn a wave of {w.burst_requests} long free-tier prompts, the turns "
            "sent once it holds the KV cache")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


ROWS = ((PREMIUM_FIRST, "premium, 1st turn"), (PREMIUM, "premium, follow-up"), (FREE, "free"))


def format_table(runs: dict[str, dict[str, TierSummary]]) -> str:
    header = (f"{'run':<21}{'requests':<20}{'TTFT p50':>9}{'TTFT p99':>9}"
              f"{'served':>7}{'429':>5}{'503':>5}{'prefix hit':>11}")
    lines = [header, "-" * len(header)]
    for run, tiers in runs.items():
        for kind, label in ROWS:
            s = tiers.get(kind, TierSummary(kind))
            hit = "-" if s.prefix_hit_rate is None or kind == FREE else f"{s.prefix_hit_rate:.0%}"
            lines.append(
                f"{run:<21}{label:<20}{_ms(s.percentile(50)):>9}{_ms(s.percentile(99)):>9}"
                f"{s.admitted:>7}{s.rejected_quota:>5}{s.rejected_watermark:>5}{hit:>11}"
            )
    return "\n".join(lines)


def _as_json(runs: dict[str, dict[str, TierSummary]], verdict: Verdict,
             results: dict[str, list[Result]]) -> dict[str, Any]:
    return {
        "runs": {
            run: {
                kind: {**asdict(s), "ttft_p50": s.percentile(50), "ttft_p99": s.percentile(99),
                       "prefix_hit_rate": s.prefix_hit_rate}
                for kind, s in tiers.items()
            }
            for run, tiers in runs.items()
        },
        "verdict": verdict.as_json(),
        "requests": {run: [asdict(r) for r in rs] for run, rs in results.items()},
    }


def run_demo(run: Path, workload: NoisyNeighbour, json_out: Path | None) -> int:
    say = _Progress()
    procs = Processes()
    try:
        with terminate_as_interrupt():
            say("generating the tiny model (cached after the first run)")
            model = tiny_model()
            # Generating the model imported torch: a full collection would walk its
            # ~350,000 objects and stall the load generator mid-measurement.
            freeze_startup_objects()
            results = {
                POLICY_RUN: _run_policy_on(procs, model, run, workload, say),
                STOCK_RUN: _run_stock(procs, model, run, workload, say),
            }
    except KeyboardInterrupt:
        print("interrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    runs = {name: summarise(rs) for name, rs in results.items()}
    verdict = judge(runs, expected_follow_ups=workload.follow_ups)
    print()
    print(format_table(runs))
    print()
    print("\n".join(verdict.lines()))
    if json_out:
        json_out.write_text(json.dumps(_as_json(runs, verdict, results), indent=2))
    say(f"done; logs in {run}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the noisy-neighbour demo on this machine (CPU, tiny model)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where logs, policies and generated keys go (default: "
                        "$XDG_CACHE_HOME/kvquota/demo)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--sessions", type=int, default=NoisyNeighbour.premium_sessions,
                        help="premium conversations")
    parser.add_argument("--turns", type=int, default=NoisyNeighbour.turns)
    parser.add_argument("--burst", type=int, default=NoisyNeighbour.burst_requests,
                        help="free-tier requests per wave")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    require("kvquota demo", "vllm", "torch", "tokenizers", "safetensors")
    workload = NoisyNeighbour(
        premium_sessions=args.sessions, turns=args.turns, burst_requests=args.burst
    )
    return run_demo(args.run_dir or user_cache() / "demo", workload, args.json)
