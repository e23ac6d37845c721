"""`python -m kvquota_lab.twin.bench_schedule`: schedule() cost, KVQuota plugin vs stock vLLM.

Both run vLLM's real V1 scheduler (priority policy) in the twin harness with N
requests decoding. The plugin runs as in production: a policy with three tenants,
every request classified with a session, idle leased sessions pinning blocks, and the
stats file published (every 0.25 s of virtual time, 10 ms per step). The two
schedulers step alternately in one process, so machine noise hits both alike; the
ratio is the median over paired steps of plugin time / stock time; `mean ratio` is
total plugin time / total stock time, which also carries the steps that publish the
stats file. With `--pressure`
the KV cache only just holds the admitted prompts, so decode growth preempts. A
benchmark, not a test: the absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy, LeasePolicy, TenantPolicy
from kvquota_lab.twin.harness import SchedulerHarness, SchedulerKind, StepRecord, TwinConfig

BLOCK_SIZE = 16
PROMPT_TOKENS = 128
IDLE_LEASED_SESSIONS = 32
TENANTS = (("gold", "premium", 0), ("silver", "standard", 1), ("bronze", "free", 2))


def _policy(num_blocks: int) -> EnginePolicy:
    share = num_blocks // len(TENANTS)
    return EnginePolicy(
        pool="bench/pool",
        model="tiny",
        block_size=BLOCK_SIZE,
        tenants={
            name: TenantPolicy(
                tenant_id=name, tier=tier, priority=priority, guaranteed_blocks=share // 2,
                max_blocks_per_engine=num_blocks, lease=LeasePolicy(seconds=3600),
                max_tokens=1 << 20,
                default_max_tokens=64,
            )
            for name, tier, priority in TENANTS
        },
    ).with_version()


def _build(
    kind: SchedulerKind, model_dir: Path, num_running: int, num_steps: int, pressure: bool,
    workdir: Path,
) -> SchedulerHarness:
    """A harness with `num_running` requests admitted and decoding."""
    leased = IDLE_LEASED_SESSIONS * 10
    if pressure:  # room to admit everyone; decode growth then overflows the cache
        num_blocks = num_running * (PROMPT_TOKENS // BLOCK_SIZE + 4) + leased
    else:
        num_blocks = num_running * ((PROMPT_TOKENS + 2 * num_steps + 64) // BLOCK_SIZE + 2)
        num_blocks += leased + 64
    plugin = kind == "kvquota"
    policy_path = workdir / f"{kind}-policy.json"
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
    return harness


def _measure(
    model_dir: Path, num_running: int, num_steps: int, pressure: bool, workdir: Path
) -> tuple[list[StepRecord], list[StepRecord]]:
    stock = _build("stock-priority", model_dir, num_running, num_steps, pressure, workdir)
    plugin = _build("kvquota", model_dir, num_running, num_steps, pressure, workdir)
    try:
        gc.collect()
        pairs = [(stock.step(), plugin.step()) for _ in range(num_steps)]
    finally:
        stock.shutdown()
        plugin.shutdown()
    return [s for s, _ in pairs], [p for _, p in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: generate the tiny model)")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200, help="measured step pairs per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pressure", action="store_true",
                        help="KV cache sized so that decode growth keeps preempting")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvq-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from kvquota_lab.tinymodel import generate

            model_dir = generate(workdir / "tiny-model")
        print(f"schedule() per step: {args.rounds} rounds x {args.steps} paired steps"
              f"{', under KV pressure' if args.pressure else ''}")
        print(f"{'running':>8} {'stock us':>9} {'kvquota us':>11} {'ratio':>6} "
              f"{'mean ratio':>11} {'+update ratio':>14} {'preemptions stock/kvq':>22}")
        worst = 0.0
        for num_running in args.running:
            stock: list[StepRecord] = []
            plugin: list[StepRecord] = []
            for _ in range(args.rounds):
                rounds = _measure(model_dir, num_running, args.steps, args.pressure, workdir)
                stock += rounds[0]
                plugin += rounds[1]
            ratio = statistics.median(
                p.schedule_seconds / s.schedule_seconds for s, p in zip(stock, plugin, strict=True)
            )
            full_ratio = statistics.median(
                (p.schedule_seconds + p.update_seconds) / (s.schedule_seconds + s.update_seconds)
                for s, p in zip(stock, plugin, strict=True)
            )
            mean_ratio = sum(p.schedule_seconds for p in plugin) / sum(
                s.schedule_seconds for s in stock
            )
            worst = max(worst, ratio)
            print(f"{num_running:>8} "
                  f"{statistics.median(s.schedule_seconds for s in stock) * 1e6:>9.0f} "
                  f"{statistics.median(p.schedule_seconds for p in plugin) * 1e6:>11.0f} "
                  f"{ratio:>6.2f} {mean_ratio:>11.2f} {full_ratio:>14.2f} "
                  f"{sum(len(s.preempted_req_ids) for s in stock):>11}/"
                  f"{sum(len(p.preempted_req_ids) for p in plugin):<10}")
        print(f"worst schedule() ratio {worst:.2f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
