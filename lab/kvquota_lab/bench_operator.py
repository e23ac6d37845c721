"""Operator benchmark (a command, not a test): `python -m kvquota_lab.bench_operator`.

1. Render: plan one pool of N TenantQuotas (admission, effective settings, split),
   render the EnginePolicy and the ConfigMap, and write the policy file as local mode
   does. Target: < 1 s for 1,000 tenants.
2. The real operator (`kvquota operator`, its own process, as in a cluster) against
   the KMock emulator over HTTP:
   - burst: N TenantQuotas created at once (32 in flight); the time from the last
     create's response to the ConfigMap holding all N. Target: < 5 s for 1,000.
   - change-to-ConfigMap: then one quota at a time is edited; each sample is the time
     from sending the PATCH to the ConfigMap holding the new guarantee.
     Target: p99 < 1 s at 1,000 tenants. Beside it: the operator's CPU per edit, the
     CPU of this process (the emulator serving both sides, and the client), and the
     operator's own view (kvquota_operator_change_to_configmap_seconds: from its
     handler seeing the edit to the ConfigMap written), so the time spent in the
     emulator and in kopf's watch stands apart from the reconcile's.
   - memory: the operator's RSS once the N quotas have settled, and again with
     `--rss-tenants` (default 10,000) in pools of N each, with the time from the last
     create to every status written (settled). (One pool cannot hold
     10,000: its policy ConfigMap would pass the API server's 1 MiB request limit
     at about 1,900 tenants, which KMock enforces too.)

Needs the `test` extra (kmock). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquota_lab.percentile import percentile

TARGET_RENDER_S = 1.0
TARGET_BURST_S = 5.0
TARGET_P99_S = 1.0
POOL = "bench-pool"
IN_FLIGHT = 32  # concurrent creates, like a `kubectl apply` of many files in parallel
SETTLE_PAUSE = 3.0  # after the last status: the last events posted, memory steady
# The edited pool's capacity per quota: edits set guarantees of 11..21 blocks, and
# 40 x (1 - watermark 0.15) = 34 keeps every edit admitted (a refused edit would never
# show its new guarantee in the policy).
EDIT_CAPACITY_PER_QUOTA = 40


def _pool(capacity: int, name: str = POOL) -> dict[str, Any]:
    return {
        "apiVersion": "kvquota.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "bench"}}, "model": "bench",
                 "kvCache": {"capacityBlocks": capacity}},
    }


def _quota(i: int, guaranteed: int, pool: str = POOL) -> dict[str, Any]:
    tier = ("premium", "standard", "free")[i % 3]
    return {
        "apiVersion": "kvquota.dev/v1alpha1", "kind": "TenantQuota",
        "metadata": {"name": f"tenant-{i:05d}", "namespace": "default"},
        "spec": {"poolRef": {"name": pool}, "tier": tier,
                 "kvCache": {"guaranteedBlocks": guaranteed, "maxBlocks": guaranteed * 4,
                             "lease": {"maxSessions": 4}},
                 "limits": {"maxConcurrentRequests": 8}},
    }


def bench_render(tenants: int, repeats: int) -> list[float]:
    from engine_sidecar.contract.files import write_atomically
    from kvquota.policy.plan import plan_pool
    from kvquota.reconcile.configmap import build_configmap

    pool = _pool(capacity=tenants * 20)
    quotas = [_quota(i, 10) for i in range(tenants)]
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            start = time.perf_counter()
            plan = plan_pool(pool, quotas, namespace="default", name=POOL, ready_replicas=4)
            assert plan.policy is not None and len(plan.policy.tenants) == tenants
            build_configmap("default", POOL, "uid", plan.policy)
            write_atomically(Path(tmp) / "policy.json", plan.policy.to_json())
            times.append(time.perf_counter() - start)
    return times


@dataclass
class ProcessResult:
    tenants: int
    creates_s: float = 0.0  # first create sent -> last create answered
    burst_s: float = 0.0  # last create answered -> ConfigMap holds every tenant
    edits: list[float] = field(default_factory=list)
    rss: dict[int, int] = field(default_factory=dict)  # tenants -> operator RSS (bytes)
    settled_s: dict[int, float] = field(default_factory=dict)  # last create -> statuses


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus exposition text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def bench_operator_process(tenants: int, changes: int, rss_tenants: int,
                                 workdir: Path) -> ProcessResult:
    import aiohttp

    from engine_sidecar.contract.names import POLICY_FILE
    from kvquota.reconcile.configmap import HASH_ANNOTATION, configmap_name
    from kvquota_lab.emulator import serve
    from kvquota_lab.emulator_process import OperatorProcess

    base = "/apis/kvquota.dev/v1alpha1/namespaces/default"
    result = ProcessResult(tenants)
    async with serve() as (server, url), aiohttp.ClientSession(url) as http:

        async def wait_policy(check: Any, timeout: float = 1800.0, pool: str = POOL
                              ) -> dict[str, Any]:
            """Watch the ConfigMap as stored in the emulator (in-process, no HTTP);
            parse only new content."""
            deadline = time.perf_counter() + timeout
            last_hash = None
            while time.perf_counter() < deadline:
                cm = server.stored("v1/configmaps", "default", configmap_name(pool))
                current = cm and cm["metadata"].get("annotations", {}).get(HASH_ANNOTATION)
                if cm and current != last_hash:
                    last_hash = current
                    policy = json.loads(cm["data"][POLICY_FILE])
                    if check(policy):
                        return dict(policy)
                await asyncio.sleep(0.002)
            raise TimeoutError("the ConfigMap did not converge")

        async def create_quotas(first: int, last: int, pool: str = POOL) -> float:
            """Create quotas first..last-1; returns when the last create was answered."""
            limit = asyncio.Semaphore(IN_FLIGHT)

            async def create(i: int) -> None:
                body = _quota(i, 10, pool)
                async with limit, http.post(f"{base}/tenantquotas", json=body) as r:
                    if r.status >= 400:
                        raise RuntimeError(f"create tenant-{i:05d}: {r.status}")

            await asyncio.gather(*(create(i) for i in range(first, last)))
            return time.perf_counter()

        async def settle(count: int, timeout: float = 900.0) -> None:
            """Every quota's status written: the burst is over."""
            deadline = time.perf_counter() + timeout
            pending = list(range(count))
            while pending and time.perf_counter() < deadline:
                pending = [i for i in pending if not (server.stored(
                    "kvquota.dev/v1alpha1/tenantquotas", "default", f"tenant-{i:05d}")
                    or {}).get("status", {}).get("conditions")]
                await asyncio.sleep(0.2)
            await asyncio.sleep(SETTLE_PAUSE)  # the last events posted, memory steady

        operator = OperatorProcess(url, workdir, args=[
            "--standalone", "--poll-interval", "3600"])
        await operator.start()
        try:
            async with http.post(f"{base}/inferencepools",
                                 json=_pool(tenants * EDIT_CAPACITY_PER_QUOTA)):
                pass
            start = time.perf_counter()
            last_create = await create_quotas(0, tenants)
            await wait_policy(lambda p: len(p["tenants"]) == tenants)
            done = time.perf_counter()
            result.creates_s, result.burst_s = last_create - start, done - last_create
            await settle(tenants)
            result.settled_s[tenants] = time.perf_counter() - last_create - SETTLE_PAUSE
            result.rss[tenants] = operator.rss_bytes()
            report(f"operator RSS at {tenants} TenantQuotas: "
                   f"{result.rss[tenants] / 2**20:.0f} MiB (every status written "
                   f"{result.settled_s[tenants]:.1f} s after the last create)")
            report(f"operator process: {tenants} TenantQuotas created in "
                   f"{result.creates_s:.2f} s ({IN_FLIGHT} in flight); last create -> "
                   f"ConfigMap with all of them: {result.burst_s:.2f} s "
                   f"(target < {TARGET_BURST_S:.0f} s)")

            rng = random.Random(7)
            guarantees = dict.fromkeys(range(tenants), 10)
            cpu_before, own_before = operator.cpu_seconds(), _own_cpu_seconds()
            seen_before = await operator.metrics()
            for n in range(changes):
                i, value = rng.randrange(tenants), 11 + n % 10
                value = 21 if value == guarantees[i] else value  # always a change
                guarantees[i] = value
                name = f"tenant-{i:05d}"
                patch = {"spec": {"kvCache": {"guaranteedBlocks": value}}}
                sent = time.perf_counter()
                async with http.patch(f"{base}/tenantquotas/{name}", json=patch,
                                      headers={"Content-Type": "application/merge-patch+json"}):
                    pass
                await wait_policy(
                    lambda p, name=name, value=value: (
                        p["tenants"][name]["guaranteedBlocks"] == value // p["replicas"]))
                result.edits.append(time.perf_counter() - sent)
            report_edits(tenants, result.edits)
            if changes:
                cpu = (operator.cpu_seconds() - cpu_before) / changes
                own = (_own_cpu_seconds() - own_before) / changes
                seen = await operator.metrics()
                histogram = "kvquota_operator_change_to_configmap_seconds"
                count = (_metric(seen, histogram + "_count")
                         - _metric(seen_before, histogram + "_count"))
                mean = (_metric(seen, histogram + "_sum")
                        - _metric(seen_before, histogram + "_sum")) / max(count, 1)
                wall = statistics.fmean(result.edits)
                report(f"per edit at {tenants} tenants: wall {wall * 1000:.0f} ms (mean); "
                       f"operator CPU {cpu * 1000:.0f} ms; emulator+client CPU (this "
                       f"process) {own * 1000:.0f} ms; operator handler -> ConfigMap "
                       f"{mean * 1000:.0f} ms (mean of its own metric)")
                report(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: "
                       "the latencies above include waiting for a CPU")

            for first in range(tenants, rss_tenants, tenants):
                pool, last = f"{POOL}-{first // tenants}", min(first + tenants, rss_tenants)
                async with http.post(f"{base}/inferencepools", json=_pool(tenants * 20, pool)):
                    pass
                await create_quotas(first, last, pool)
                await wait_policy(lambda p, n=last - first: len(p["tenants"]) == n, pool=pool)
            if rss_tenants > tenants:
                last_create = time.perf_counter()
                await settle(rss_tenants)
                settled = time.perf_counter() - last_create - SETTLE_PAUSE
                result.settled_s[rss_tenants] = settled
                result.rss[rss_tenants] = operator.rss_bytes()
                report(f"operator RSS at {rss_tenants} TenantQuotas: "
                       f"{result.rss[rss_tenants] / 2**20:.0f} MiB (every status written "
                       f"{settled:.1f} s after the last pool's ConfigMap was complete)")
        finally:
            code = await operator.stop()
            if code not in (0, None):
                print(f"operator exited with {code}:\n{operator.log_tail()}")
    return result


def report(line: str) -> None:
    print(line, flush=True)


def report_edits(tenants: int, samples: list[float]) -> None:
    if not samples:
        return
    p50, p99 = percentile(samples, 50) or 0.0, percentile(samples, 99) or 0.0
    slowest = sorted(range(len(samples)), key=samples.__getitem__)[-3:]
    report("slowest edits (index: ms): "
           + ", ".join(f"{i}: {samples[i] * 1000:.0f}" for i in reversed(slowest)))
    report(f"change-to-ConfigMap over {len(samples)} edits at {tenants} tenants: "
           f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
           f"max {max(samples) * 1000:.0f} ms (target p99 < {TARGET_P99_S * 1000:.0f} ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvquota_lab.bench_operator",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="render repetitions")
    parser.add_argument("--rss-tenants", type=int, default=10000,
                        help="quotas (in pools of --tenants) for the second RSS figure")
    args = parser.parse_args(argv)

    renders = bench_render(args.tenants, args.repeats)
    median = statistics.median(renders)
    report(f"render+write, {args.tenants} tenants in one pool: median {median * 1000:.0f} ms, "
          f"max {max(renders) * 1000:.0f} ms over {args.repeats} runs "
          f"(target < {TARGET_RENDER_S * 1000:.0f} ms)")

    with tempfile.TemporaryDirectory(prefix="kvquota-bench-") as tmp:
        asyncio.run(bench_operator_process(
            args.tenants, args.changes, max(args.rss_tenants, args.tenants), Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
