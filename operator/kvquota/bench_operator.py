"""Operator benchmark (a command, not a test): `python -m kvquota.bench_operator`.

1. Render: plan one pool of N TenantQuotas (admission, effective settings, split),
   render the EnginePolicy and the ConfigMap, and write the policy file as local mode
   does. Target: < 1 s for 1,000 tenants.
2. Change-to-ConfigMap: the real operator (kopf) against the KMock emulator over
   HTTP. N quotas are created, then one quota at a time is edited; each sample is the
   time from sending the PATCH to the ConfigMap holding the new guarantee.
   Target: p99 < 2 s for 1,000 tenants.

Needs the `test` extra (kmock). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_RENDER_S = 1.0
TARGET_P99_S = 2.0
POOL = "bench-pool"


def _pool(capacity: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvquota.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "bench"}}, "model": "bench",
                 "kvCache": {"capacityBlocks": capacity}},
    }


def _quota(i: int, guaranteed: int) -> dict[str, Any]:
    tier = ("premium", "standard", "free")[i % 3]
    return {
        "apiVersion": "kvquota.dev/v1alpha1", "kind": "TenantQuota",
        "metadata": {"name": f"tenant-{i:05d}", "namespace": "default"},
        "spec": {"poolRef": {"name": POOL}, "tier": tier,
                 "kvCache": {"guaranteedBlocks": guaranteed, "maxBlocks": guaranteed * 4,
                             "lease": {"maxSessions": 4}},
                 "limits": {"maxConcurrentRequests": 8}},
    }


def bench_render(tenants: int, repeats: int) -> list[float]:
    from engine_sidecar.policy import write_atomically
    from kvquota.plan import plan_pool
    from kvquota.render import build_configmap

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


async def bench_changes(tenants: int, changes: int) -> tuple[float, list[float]]:
    import aiohttp

    from kvquota.emulator import OperatorRunner, serve
    from kvquota.render import HASH_ANNOTATION, POLICY_KEY, configmap_name
    from kvquota.runtime import OperatorConfig

    base = "/apis/kvquota.dev/v1alpha1/namespaces/default"
    async with serve() as (server, url), aiohttp.ClientSession(url) as http:

        async def wait_policy(check: Any, timeout: float = 60.0) -> dict[str, Any]:
            """Watch the ConfigMap as stored in the emulator (in-process: polling it over
            HTTP would steal the CPU being measured); parse only new content."""
            deadline = time.perf_counter() + timeout
            last_hash = None
            while time.perf_counter() < deadline:
                cm = server.stored("v1/configmaps", "default", configmap_name(POOL))
                current = cm and cm["metadata"].get("annotations", {}).get(HASH_ANNOTATION)
                if cm and current != last_hash:
                    last_hash = current
                    policy = json.loads(cm["data"][POLICY_KEY])
                    if check(policy):
                        return dict(policy)
                await asyncio.sleep(0.002)
            raise TimeoutError("the ConfigMap did not converge")

        runner = OperatorRunner(OperatorConfig(api_server=url, poll_interval=3600))
        await runner.start()
        try:
            start = time.perf_counter()
            async with http.post(f"{base}/inferencepools", json=_pool(tenants * 20)):
                pass
            limit = asyncio.Semaphore(32)

            async def create(i: int) -> None:
                async with limit, http.post(f"{base}/tenantquotas", json=_quota(i, 10)):
                    pass

            await asyncio.gather(*(create(i) for i in range(tenants)))
            await wait_policy(lambda p: len(p["tenants"]) == tenants, timeout=300)
            initial = time.perf_counter() - start

            def settled() -> bool:  # every quota's status written: the burst is over
                return all(
                    (server.stored("kvquota.dev/v1alpha1/tenantquotas", "default",
                                   f"tenant-{i:05d}") or {}).get("status", {}).get("conditions")
                    for i in range(tenants))

            deadline = time.perf_counter() + 300
            while not settled() and time.perf_counter() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(6.0)

            rng = random.Random(7)
            samples = []
            for n in range(changes):
                i, value = rng.randrange(tenants), 11 + n
                name = f"tenant-{i:05d}"
                patch = {"spec": {"kvCache": {"guaranteedBlocks": value}}}
                start = time.perf_counter()
                async with http.patch(f"{base}/tenantquotas/{name}", json=patch,
                                      headers={"Content-Type": "application/merge-patch+json"}):
                    pass
                await wait_policy(
                    lambda p, name=name, value=value: (
                        p["tenants"][name]["guaranteedBlocks"] == value // p["replicas"]))
                samples.append(time.perf_counter() - start)
        finally:
            await runner.stop()
    return initial, samples


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvquota.bench_operator",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="render repetitions")
    args = parser.parse_args(argv)

    renders = bench_render(args.tenants, args.repeats)
    median = statistics.median(renders)
    print(f"render+write, {args.tenants} tenants in one pool: median {median * 1000:.0f} ms, "
          f"max {max(renders) * 1000:.0f} ms over {args.repeats} runs "
          f"(target < {TARGET_RENDER_S * 1000:.0f} ms)")

    initial, samples = asyncio.run(bench_changes(args.tenants, args.changes))
    print(f"emulator: {args.tenants} TenantQuotas created -> ConfigMap with all of them: "
          f"{initial:.2f} s")
    p50, p99 = _percentile(samples, 0.50), _percentile(samples, 0.99)
    slowest = sorted(range(len(samples)), key=samples.__getitem__)[-3:]
    print("slowest edits (index: ms): "
          + ", ".join(f"{i}: {samples[i] * 1000:.0f}" for i in reversed(slowest)))
    print(f"change-to-ConfigMap over {len(samples)} edits: p50 {p50 * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {max(samples) * 1000:.0f} ms "
          f"(target p99 < {TARGET_P99_S * 1000:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
