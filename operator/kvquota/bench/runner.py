"""Run a scenario under every policy on one backend and build the report document."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvquota.bench.cost import CostProfile, load_profile
from kvquota.bench.metrics import RunResult
from kvquota.bench.report import build_document
from kvquota.bench.scenario import Scenario, generate_sessions, load_scenario

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
    engine_args: dict[str, Any] = field(default_factory=dict)


class ProgressBar:
    """One line per policy on stderr: a bar over the requests settled so far."""

    WIDTH = 28

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self._started: dict[str, float] = {}
        self._done: set[str] = set()

    def __call__(self, key: str, settled: int, planned: int, virtual: float) -> None:
        if not self.enabled or key in self._done:
            return
        started = self._started.setdefault(key, time.perf_counter())
        wall = time.perf_counter() - started
        fraction = settled / planned if planned else 1.0
        finished = settled >= planned
        if not self.tty and not finished:
            return
        filled = round(self.WIDTH * min(fraction, 1.0))
        bar = "#" * filled + "." * (self.WIDTH - filled)
        line = (f"{key:<18} [{bar}] {fraction:4.0%} {settled}/{planned} requests  "
                f"t={virtual:,.0f}s  wall {wall:.1f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if finished else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        if finished:
            self._done.add(key)


def _policy_specs(options: BenchOptions) -> list[Any]:
    from kvquota.bench.twin import POLICIES, PolicySpec

    unknown = [p for p in options.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    specs: list[PolicySpec] = [POLICIES[p] for p in options.policies]
    if options.victim_orders:
        from kvquota.bench.variants import victim_order_specs

        specs += victim_order_specs(options.victim_orders)
    return specs


def _baseline_scenario(scenario: Scenario) -> Scenario | None:
    dropped = [t for t in scenario.baseline.drop_tiers if t in scenario.tiers]
    kept = [t for t in scenario.tiers if t not in dropped]
    if not dropped or not kept:
        return None
    return scenario.without_tiers(dropped)


def run_bench(options: BenchOptions, out: TextIO | None = None) -> dict[str, Any]:
    """Run everything `options` asks for; returns the report document."""
    scale = options.scale
    if options.backend == "engine" and scale is None:
        from kvquota.bench.scenario import scenario_scales

        if "engine" in scenario_scales(options.scenario):
            scale = "engine"
    scenario = load_scenario(options.scenario, scale=scale, seed=options.seed)
    sessions = generate_sessions(scenario)
    num_requests = sum(len(s.turns) for s in sessions)
    progress = ProgressBar(enabled=options.progress)
    base_scenario = _baseline_scenario(scenario) if options.baseline else None
    if out is not None:
        out.write(f"{scenario.name}: {len(sessions)} sessions, {num_requests} requests, "
                  f"{scenario.engine.capacity_blocks} KV blocks, backend {options.backend}\n")
        out.flush()
    profile: CostProfile | None = None
    runs: list[RunResult] = []
    baseline: RunResult | None = None
    if options.backend == "twin":
        from kvquota.bench.twin import BASELINE, run_twin

        profile = load_profile(options.profile or scenario.profile)
        for spec in _policy_specs(options):
            runs.append(run_twin(scenario, sessions, spec, profile, progress))
        if base_scenario is not None:
            baseline = run_twin(base_scenario, generate_sessions(base_scenario), BASELINE,
                                profile, progress)
    elif options.backend == "engine":
        from kvquota.bench.engine_backend import run_engine_bench

        if options.victim_orders:
            raise ValueError("victim-order variants run in the twin only")
        runs, baseline = run_engine_bench(
            scenario, sessions, list(options.policies), base_scenario, progress,
            **options.engine_args,
        )
    else:
        raise ValueError(f"unknown backend {options.backend!r}; choose twin or engine")
    return build_document(
        scenario, source=options.scenario, scale=scale, backend=options.backend,
        profile=profile, runs=runs, baseline=baseline, num_sessions=len(sessions),
        num_requests=num_requests,
    )
