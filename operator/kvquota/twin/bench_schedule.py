"""`python -m kvquota.twin.bench_schedule`: schedule() cost, KVQuota plugin vs stock vLLM.

Both run vLLM's real V1 scheduler (priority policy) in the twin harness with N
requests decoding. The plugin runs as in production: a policy with three tenants,
every request classified with a session, idle leased sessions pinning blocks, and the
stats file published (every 0.25 s of virtual time, 10 ms per step). Rounds alternate
stock and plugin; the figure is the median over rounds of each run's median
per-step time. With `--pressure` the KV cache is 30% too small, so steps preempt.
This is a benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.policy import EnginePolicy, LeasePolicy, TenantPolicy, write_atomically
from kvquota.twin.harness import SchedulerHarness, SchedulerKind, TwinConfig

BLOCK_SIZE = 16
PROMPT_TOKENS = 128
IDLE_LEASED_SESSIONS = 32
TENANTS = (("gold", "premium", 0), ("silver", "standard", 1), ("bronze", "free", 2))


@dataclass
class Sample:
    schedule_us: float
    step_us: float  # schedule() + update_from_output()
    preemptions: int


def _policy(num_blocks: int) -> EnginePolicy:
    share = num_blocks // len(TENANTS)
    return EnginePolicy(
        pool="bench/pool",
        model="tiny",
        block_size=BLOCK_SIZE,
        tenants={
            name: TenantPolicy(
                tenant_id=name, tier=tier, priority=priority, guaranteed_blocks=share // 2,
                max_blocks=num_blocks, lease=LeasePolicy(seconds=3600), max_tokens=1 << 20,
                default_max_tokens=64,
            )
            for name, tier, priority in TENANTS
        },
    ).with_version()


def _run(
    kind: SchedulerKind, model_dir: Path, num_running: int, num_steps: int, pressure: bool,
    workdir: Path,
) -> Sample:
    blocks_per_request = (PROMPT_TOKENS + num_steps + 64) // BLOCK_SIZE + 2
    demand = num_running * blocks_per_request + IDLE_LEASED_SESSIONS * 10
    num_blocks = int(demand * 0.7) if pressure else demand + 64
    plugin = kind == "kvquota"
    policy_path = workdir / "policy.json"
    write_atomically(policy_path, _policy(num_blocks).to_json())
    harness = SchedulerHarness(TwinConfig(
        model_dir=model_dir,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        scheduler=kind,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(8192, 4 * num_running),
        policy_path=policy_path if plugin else None,
        stats_path=workdir / "stats.json" if plugin else None,
    ))
    try:
        counter = 0

        def prompt() -> list[int]:
            nonlocal counter
            counter += 1
            return [16 + (counter * 7919 + i * 104729) % 2000 for i in range(PROMPT_TOKENS)]

        # Idle sessions that finished a turn: leased under the plugin, LRU-cached in stock.
        for i in range(IDLE_LEASED_SESSIONS):
            name, _, priority = TENANTS[i % len(TENANTS)]
            harness.add_request(None, prompt() + prompt()[:32], 4, priority=priority,
                                tenant=name, session=f"idle-{i}")
        harness.run_until_done()
        for i in range(num_running):
            name, _, priority = TENANTS[i % len(TENANTS)]
            harness.add_request(None, prompt(), 1 << 20, priority=priority, tenant=name,
                                session=f"s-{i}")
        # Warm up until every request is admitted and decoding (under pressure that
        # never settles: preempted requests keep coming back).
        for _ in range(200 if pressure else 10_000):
            record = harness.step()
            if record.num_prefill_tokens == 0 and record.num_decode_seqs == num_running:
                break
        gc.collect()
        records = [harness.step() for _ in range(num_steps)]
    finally:
        harness.shutdown()
    return Sample(
        schedule_us=statistics.median(r.schedule_seconds for r in records) * 1e6,
        step_us=statistics.median(r.schedule_seconds + r.update_seconds for r in records) * 1e6,
        preemptions=sum(len(r.preempted_req_ids) for r in records),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: generate the tiny model)")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=100, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pressure", action="store_true",
                        help="KV cache 30%% short of demand (preemptions every step)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvq-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from kvquota.tinymodel import generate

            model_dir = generate(workdir / "tiny-model")
        print(f"schedule() per step, median of {args.rounds} rounds x {args.steps} steps"
              f"{' under KV pressure' if args.pressure else ''}")
        print(f"{'running':>8} {'stock us':>10} {'kvquota us':>11} {'ratio':>6} "
              f"{'stock+upd us':>13} {'kvq+upd us':>11} {'ratio':>6} {'preempt s/k':>12}")
        worst = 0.0
        for num_running in args.running:
            runs: dict[str, list[Sample]] = {"stock-priority": [], "kvquota": []}
            for _ in range(args.rounds):
                for kind in runs:
                    runs[kind].append(_run(kind, model_dir, num_running, args.steps,  # type: ignore[arg-type]
                                           args.pressure, workdir))
            stock, plugin = (
                Sample(
                    statistics.median(s.schedule_us for s in samples),
                    statistics.median(s.step_us for s in samples),
                    samples[0].preemptions,
                )
                for samples in runs.values()
            )
            ratio = plugin.schedule_us / stock.schedule_us
            worst = max(worst, ratio)
            print(f"{num_running:>8} {stock.schedule_us:>10.0f} {plugin.schedule_us:>11.0f} "
                  f"{ratio:>6.2f} {stock.step_us:>13.0f} {plugin.step_us:>11.0f} "
                  f"{plugin.step_us / stock.step_us:>6.2f} "
                  f"{stock.preemptions:>5}/{plugin.preemptions:<6}")
        print(f"worst schedule() ratio {worst:.2f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
