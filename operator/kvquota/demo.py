"""`kvquota demo`: the whole product on one machine, noisy neighbour with policy on and off.

1. generates the tiny model; copies `manifests/samples/` into a run directory;
2. runs the operator in local mode on it (policy JSON + status files);
3. starts vLLM's CPU server with the TenantAwareScheduler plugin and the sidecar in
   front of it, and drives the workload through the sidecar with real JWTs;
4. restarts vLLM stock (FCFS, no plugin, no sidecar) and drives the same workload;
5. prints TTFT p50/p99, admissions and prefix-hit rate per tier for both runs.
Every process it starts is stopped on exit, error or Ctrl-C.
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

from kvquota.loadgen import NoisyNeighbour, Target, TierSummary, run_noisy_neighbour, summarise
from kvquota.processes import ManagedProcess
from kvquota.stack import (
    Processes,
    engine_process,
    sidecar_process,
    terminate_as_interrupt,
    wait_for_file,
)

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
KV_CACHE_BYTES = 10 * 1024 * 1024  # 640 blocks of 32 tokens: the samples' capacityBlocks


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
    shutil.copytree(SAMPLES, manifests, ignore=shutil.ignore_patterns("kustomization.yaml"))
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


def _engine(model: Path, run: Path, name: str, plugin: bool) -> tuple[ManagedProcess, str]:
    return engine_process(model, run, name, plugin=plugin, kv_cache_bytes=KV_CACHE_BYTES,
                          extra_args=["--enable-prompt-tokens-details"])


def _run_policy_on(
    procs: Processes, model: Path, run: Path, workload: NoisyNeighbour, say: _Progress
) -> dict[str, TierSummary]:
    manifests, secrets_dir, auth = _prepare(run)
    say("operator (local mode) renders manifests/samples into an EnginePolicy")
    operator = procs.start(ManagedProcess(
        "operator", [sys.executable, "-m", "kvquota.cli", "operator", "--local", str(manifests)],
        run / "operator.log",
    ))
    policy_file = wait_for_file(
        lambda: sorted((manifests / ".policies").glob("*.json")), operator, 60
    )
    say(f"policy {policy_file.name}; starting vLLM (CPU) with the TenantAwareScheduler plugin")
    engine, engine_url = _engine(model, run, "vllm-policy", plugin=True)
    procs.start(engine).wait_http(engine_url + "/health", 300)
    sidecar, sidecar_url = sidecar_process(
        engine.env, engine_url, run, policy_file=policy_file, secrets_dir=secrets_dir,
        tokenizer=model,
    )
    procs.start(sidecar)
    sidecar.wait_http(sidecar_url + "/readyz", 120)
    say("sidecar ready; running the noisy-neighbour workload through it")
    headers = {tenant: {"Authorization": f"Bearer {auth.token(tenant)}"}
               for tenant in (workload.premium_tenant, workload.free_tenant)}
    target = Target(sidecar_url, str(model), lambda tenant: headers[tenant])
    results = asyncio.run(run_noisy_neighbour(target, workload))
    procs.stop_all()
    return summarise(results)


def _run_stock(
    procs: Processes, model: Path, run: Path, workload: NoisyNeighbour, say: _Progress
) -> dict[str, TierSummary]:
    say("starting stock vLLM (FCFS, no plugin, no sidecar)")
    engine, engine_url = _engine(model, run, "vllm-stock", plugin=False)
    procs.start(engine).wait_http(engine_url + "/health", 300)
    say("running the same workload straight at vLLM")
    results = asyncio.run(run_noisy_neighbour(Target(engine_url, str(model)), workload))
    procs.stop_all()
    return summarise(results)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def format_table(runs: dict[str, dict[str, TierSummary]]) -> str:
    header = (f"{'run':<22}{'tier':<9}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'admitted':>10}{'429':>6}{'503':>6}{'prefix hit':>12}")
    lines = [header, "-" * len(header)]
    for run, tiers in runs.items():
        for tier in ("premium", "free"):
            s = tiers.get(tier, TierSummary(tier))
            hit = "-" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.0%}"
            lines.append(
                f"{run:<22}{tier:<9}{_ms(s.percentile(50)):>10}{_ms(s.percentile(99)):>10}"
                f"{s.admitted:>10}{s.rejected_quota:>6}{s.rejected_watermark:>6}{hit:>12}"
            )
    return "\n".join(lines)


def _as_json(runs: dict[str, dict[str, TierSummary]]) -> dict[str, Any]:
    return {
        run: {
            tier: {**asdict(s), "ttft_p50": s.percentile(50), "ttft_p99": s.percentile(99),
                   "prefix_hit_rate": s.prefix_hit_rate}
            for tier, s in tiers.items()
        }
        for run, tiers in runs.items()
    }


def run_demo(run: Path, workload: NoisyNeighbour, json_out: Path | None) -> int:
    from kvquota.tinymodel import generate

    say = _Progress()
    procs = Processes()
    try:
        with terminate_as_interrupt():
            say("generating the tiny model (cached after the first run)")
            model = generate(REPO / ".cache" / "tiny-model")
            runs = {
                "KVQuota (policy on)": _run_policy_on(procs, model, run, workload, say),
                "stock vLLM (FCFS)": _run_stock(procs, model, run, workload, say),
            }
    except KeyboardInterrupt:
        print("interrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    print()
    print(format_table(runs))
    on, off = (runs[k].get("premium", TierSummary("premium")).percentile(99) for k in runs)
    if on and off:
        print(f"\npremium TTFT p99 with KVQuota: {on / off:.2f}x of stock vLLM "
              "under the same free-tier burst")
    if json_out:
        json_out.write_text(json.dumps(_as_json(runs), indent=2))
    say(f"done; logs in {run}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the noisy-neighbour demo on this machine (CPU, tiny model)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", type=Path, default=REPO / ".cache" / "demo",
                        help="where logs, policies and generated keys go")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--sessions", type=int, default=NoisyNeighbour.premium_sessions,
                        help="premium conversations")
    parser.add_argument("--turns", type=int, default=NoisyNeighbour.turns)
    parser.add_argument("--burst", type=int, default=NoisyNeighbour.burst_requests,
                        help="free-tier requests per wave")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    workload = NoisyNeighbour(
        premium_sessions=args.sessions, turns=args.turns, burst_requests=args.burst
    )
    return run_demo(args.run_dir, workload, args.json)
