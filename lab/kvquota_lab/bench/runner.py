"""Run a scenario under every policy on one backend and build the report document."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvquota_lab.bench.cost import CostProfile, load_profile
from kvquota_lab.bench.metrics import RunResult
from kvquota_lab.bench.report import build_document
from kvquota_lab.bench.scenario import Scenario, generate_sessions, load_scenario

if TYPE_CHECKING:
    from kvquota_lab.bench.tasks import TwinTask

DEFAULT_POLICIES = ("fcfs", "priority", "kvquota")


@dataclass
class BenchOptions:
    scenario: str
    backend: str = "twin"
    scale: str | None = None
    seed: int | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    victim_orders: tuple[str, ...] = ()
    baseline: bool = True
    profile: str | None = None
    progress: bool = True
    jobs: int = 1
    quiet: bool = False  # silence vLLM's own log notices
    engine_args: dict[str, Any] = field(default_factory=dict)
    replicas: int | None = None  # a pool of twin engines behind `router` (kvquota_lab.bench.pool)
    router: str = "round-robin"
    splits: tuple[str, ...] = ("even",)
    picker_signals: tuple[str, ...] = ("kvquota",)  # what the pool's picker reads (routers.SIGNALS)
    picker_kv_filter: float | None = None  # prefix-affinity: every KV filter's threshold
    picker_config: Path | None = None  # prefix-affinity on KVQuota's series (None: shipped)
    pool_ledger: bool = True  # the pool-wide ledger on a shared store (bench.pool_ledger)
    # Pool: single-engine KVQuota runs on this many seeds, pooled, as the protected
    # tier's reference (bench.one_engine; None: the replica count, at most 8; 0: none).
    one_engine_seeds: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # `--set`, merged into the scenario


class ProgressBar:
    """Progress on stderr: one bar over all runs (on a terminal) and a line per run
    as it finishes. Runs may report interleaved (parallel workers)."""

    WIDTH = 30

    def __init__(self, runs: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.runs = max(runs, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self._started = time.perf_counter()
        self._fractions: dict[str, float] = {}
        self._done: set[str] = set()

    def __call__(self, key: str, settled: int, planned: int, virtual: float) -> None:
        if not self.enabled or key in self._done:
            return
        self._fractions[key] = min(settled / planned, 1.0) if planned else 1.0
        wall = time.perf_counter() - self._started
        out = []
        if settled >= planned:
            self._done.add(key)
            out.append(f"{key}: {planned} requests over {virtual:,.0f} s of scenario time "
                       f"(done at {wall:.1f} s)")
        if self.tty:
            total = sum(self._fractions.values()) / self.runs
            filled = round(self.WIDTH * total)
            running = ", ".join(f"{k} {f:.0%}" for k, f in self._fractions.items()
                                if k not in self._done)
            bar = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {total:4.0%}  "
                   f"{len(self._done)}/{self.runs} runs  {wall:.0f}s  {running}")
            text = "".join(f"\r\033[K{line}\n" for line in out) + f"\r\033[K{bar}"
            if len(self._done) == self.runs:
                text += "\r\033[K"
            self.stream.write(text)
        else:
            self.stream.write("".join(line + "\n" for line in out))
        self.stream.flush()


def _policy_specs(options: BenchOptions) -> list[Any]:
    from kvquota_lab.bench.policies import POLICIES, PolicySpec

    unknown = [p for p in options.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    specs: list[PolicySpec] = [POLICIES[p] for p in options.policies]
    if options.victim_orders:
        from kvquota_lab.bench.variants import victim_order_specs

        bases = tuple(p for p in options.policies if POLICIES[p].scheduler == "kvquota")
        specs += victim_order_specs(options.victim_orders, bases or ("kvquota",))
    return specs


def _baseline_scenario(scenario: Scenario) -> Scenario | None:
    dropped = [t for t in scenario.baseline.drop_tiers if t in scenario.tiers]
    kept = [t for t in scenario.tiers if t not in dropped]
    if not dropped or not kept:
        return None
    return scenario.without_tiers(dropped)


def _one_engine_tasks(
    options: BenchOptions, scale: str | None, seed: int, specs: list[Any]
) -> list[TwinTask]:
    """A pool bench with KVQuota in it: the single-engine runs its protected tier's
    p99 is compared with (`bench.one_engine`), after the pool's own runs."""
    if options.replicas is None or not any(s.key == "kvquota" for s in specs):
        return []
    from kvquota_lab.bench.one_engine import reference_seeds, reference_tasks

    seeds = reference_seeds(seed, options.replicas, options.one_engine_seeds)
    return list(reference_tasks(options.scenario, scale, options.overrides, seeds))


def run_bench(options: BenchOptions, out: TextIO | None = None) -> dict[str, Any]:
    """Run everything `options` asks for; returns the report document."""
    scale = options.scale
    if options.backend == "engine" and scale is None:
        from kvquota_lab.bench.scenario import scenario_scales

        if "engine" in scenario_scales(options.scenario):
            scale = "engine"
    scenario = load_scenario(options.scenario, scale=scale, seed=options.seed,
                             overrides=options.overrides)
    one_engine: list[TwinTask] = []
    if options.replicas is not None:
        if options.backend != "twin":
            raise ValueError("--replicas runs in the twin only")
        from kvquota_lab.bench.pool import PoolSpec, scale_load

        PoolSpec(options.replicas, options.router,  # bad values fail before any work
                 kv_filter=options.picker_kv_filter)
        if options.router == "prefix-affinity" and "kvquota" in options.picker_signals:
            from kvquota_lab.bench.picker_config import load_picker_config

            load_picker_config(options.picker_config)
        scenario = scale_load(scenario, options.replicas)
    sessions = generate_sessions(scenario)
    num_requests = sum(len(s.turns) for s in sessions)
    base_scenario = _baseline_scenario(scenario) if options.baseline else None
    specs = _policy_specs(options) if options.backend == "twin" else []
    from kvquota_lab.bench.policies import BASELINE

    tasks: list[TwinTask] = [(scenario, spec) for spec in specs]
    if options.replicas is not None:
        from kvquota_lab.bench.pool import pool_tasks

        tasks = pool_tasks(scenario, specs, base_scenario, replicas=options.replicas,
                           router=options.router, splits=options.splits,
                           signals=options.picker_signals,
                           kv_filter=options.picker_kv_filter,
                           picker_config=options.picker_config,
                           ledger=options.pool_ledger)
        one_engine = _one_engine_tasks(options, scale, scenario.seed, specs)
        tasks += one_engine
    elif base_scenario is not None:
        tasks.append((base_scenario, BASELINE))
    num_runs = len(tasks) if specs else len(options.policies) + (base_scenario is not None)
    progress = ProgressBar(num_runs, enabled=options.progress)
    if out is not None:
        out.write(f"{scenario.name}: {len(sessions)} sessions, {num_requests} requests, "
                  f"{scenario.engine.capacity_blocks} KV blocks"
                  + (f" x {options.replicas} engines ({options.router})"
                     if options.replicas is not None else "")
                  + f", backend {options.backend}\n")
        out.flush()
    profile: CostProfile | None = None
    runs: list[RunResult] = []
    reference_runs: list[RunResult] = []
    baseline: RunResult | None = None
    if options.backend == "twin":
        from kvquota_lab.bench.tasks import run_twin_tasks

        profile = load_profile(options.profile or scenario.profile)
        results = run_twin_tasks(tasks, profile, jobs=options.jobs, progress=progress,
                                 quiet=options.quiet)
        reference_runs = results[len(results) - len(one_engine):]
        results = results[:len(results) - len(one_engine)]
        runs = results[:len(results) - (base_scenario is not None)]
        baseline = results[-1] if base_scenario is not None else None
    elif options.backend == "engine":
        from kvquota_lab.bench.engine_backend import run_engine_bench

        if options.victim_orders:
            raise ValueError("victim-order variants run in the twin only")
        runs, baseline = run_engine_bench(
            scenario, sessions, list(options.policies), base_scenario, progress,
            **options.engine_args,
        )
    else:
        raise ValueError(f"unknown backend {options.backend!r}; choose twin or engine")
    document = build_document(
        scenario, source=options.scenario, scale=scale, backend=options.backend,
        profile=profile, runs=runs, baseline=baseline, num_sessions=len(sessions),
        num_requests=num_requests,
    )
    if options.overrides:
        document["scenario"]["overrides"] = options.overrides
    if one_engine and document["comparison"].get("tier"):
        from kvquota_lab.bench.one_engine import add_reference, pooled_reference

        seeds = [task[0].seed for task in one_engine]
        add_reference(document, pooled_reference(reference_runs, seeds,
                                                 document["comparison"]["tier"]))
    if options.replicas is not None:
        from kvquota_lab.bench.picker_config import SHIPPED_CONFIG

        document["pool"] = {"replicas": options.replicas, "router": options.router,
                            "splits": list(options.splits),
                            "pickerSignals": list(options.picker_signals),
                            "pickerKvFilter": options.picker_kv_filter,
                            "pickerConfig": str(options.picker_config or SHIPPED_CONFIG),
                            "poolLedger": options.pool_ledger}
    return document
