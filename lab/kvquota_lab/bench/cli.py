"""`kvquota bench`: stock vLLM FCFS, stock priority and KVQuota, side by side.

  kvquota bench --backend twin --scenario noisy-neighbour --json out.json --plot out.png
  kvquota bench --backend engine --scenario noisy-neighbour     (the local CPU engine)
  kvquota bench list                                            (scenarios and profiles)
  kvquota bench calibrate                                       (fit the cpu-local profile)

The twin drives vLLM's real scheduler and KV cache manager on virtual time (a step-cost
profile, `--profile`); the engine backend drives the real vLLM CPU server, through the
KVQuota sidecar for the KVQuota policy. Scenarios are YAML: see
lab/kvquota_lab/bench/README.md for the format.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="compare stock vLLM and KVQuota on a scenario (twin or CPU engine)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=("run", "list", "calibrate", "suite"),
                        default="run", help="run (default), list, calibrate, or suite (every "
                        "shipped scenario at its default and a100-40gb scales, against the "
                        "targets, PASS/FAIL)")
    parser.add_argument("--backend", choices=("twin", "engine"), default="twin")
    parser.add_argument("--scenario", default=None,
                        help="a shipped scenario name or a YAML file (default: "
                        "noisy-neighbour; suite: every shipped one, or a comma list)")
    parser.add_argument("--scale", help="apply the scenario's `scales.<NAME>` overrides "
                        "(the engine backend uses `engine` when present)")
    parser.add_argument("--seed", type=int, help="override the scenario's seed")
    parser.add_argument("--policies", default="fcfs,priority,kvquota",
                        help="comma-separated: fcfs, priority, kvquota")
    parser.add_argument("--victim-orders", default="",
                        help="also run KVQuota with these victim orders (twin only; "
                        "'all' for every documented one)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run without the noisy tiers")
    parser.add_argument("--profile", help="twin step-cost profile name or YAML file "
                        "(default: the scenario's)")
    parser.add_argument("--replicas", type=int, help="twin: a pool of this many engines "
                        "behind --router, the scenario's load x N (see bench/README.md)")
    parser.add_argument("--router", default="round-robin",
                        choices=("round-robin", "least-kv", "prefix-affinity",
                                 "session-affinity"), help="pool: the router model")
    parser.add_argument("--split", default="even",
                        help="pool: how quotas are split over engines, comma-separated: "
                        "even (the operator's default), demand (kvquota.split.rebalance)")
    parser.add_argument("--picker-signals", default="kvquota",
                        help="pool: what the router reads of each engine, comma-separated: "
                        "kvquota (the default: KVQuota's per-tier series; under "
                        "prefix-affinity, the picker configuration --picker-config), vllm "
                        "(vLLM's own waiting and KV usage, the sidecar's queue unseen; "
                        "under prefix-affinity, the pickers' stock scorers); stock engines "
                        "always show vLLM's")
    parser.add_argument("--picker-config", type=Path, default=None, metavar="FILE",
                        help="pool, prefix-affinity on KVQuota's series: the llm-d Router "
                        "EndpointPickerConfig to run (default: the shipped "
                        "manifests/examples/picker/epp-config.yaml)")
    parser.add_argument("--picker-kv-filter", type=float, default=None, metavar="T",
                        help="pool, prefix-affinity: set every KV filter's threshold to T "
                        "(the configuration's endpoint-attribute-filter; with vLLM's "
                        "series, leave out engines whose KV reads T or more)")
    parser.add_argument("--pool-ledger", action=argparse.BooleanOptionalAction, default=True,
                        help="pool: KVQuota's engines share the pool-wide ledger "
                        "(InferencePool spec.poolStore), modelled in memory with a 1 ms "
                        "round trip; the report gives the share of admissions that needed "
                        "it (default on; --no-pool-ledger: each engine on its split alone)")
    parser.add_argument("--one-engine-seeds", type=int, default=None, metavar="K",
                        help="pool: compare the protected tier's TTFT p99 with K "
                        "single-engine KVQuota runs (the scenario's per-engine load) on "
                        "seeds from the pool's on, their turns pooled (default: "
                        "--replicas, at most 8; 0: none)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="PATH=VALUE", help="override a scenario setting, e.g. "
                        "pool.tiers.premium.reservation=Full (repeatable; suite: every "
                        "scenario)")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    parser.add_argument("--markdown", type=Path, help="suite: also write a markdown report")
    parser.add_argument("--seeds", type=int, default=1,
                        help="suite: also run each case with this many seeds (the "
                        "scenario's, then the next ones)")
    parser.add_argument("--plot", type=Path, help="write a PNG: TTFT CDF, KV per tier")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="twin: policies run in this many processes (default: %(default)s)")
    parser.add_argument("--out", type=Path,
                        help="calibrate: where to write the profile (default: the user "
                        "profile directory, so `--profile cpu-local` picks it up)")
    parser.add_argument("--run-dir", type=Path,
                        help="engine backend / calibrate: logs and policy files go here")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvquota_lab.bench.cost import CostProfileError
    from kvquota_lab.bench.scenario import ScenarioError, parse_overrides

    try:
        if args.action == "list":
            return _list()
        _require_extras(args)
        if args.action == "calibrate":
            from kvquota_lab.bench.calibrate import calibrate_command

            return calibrate_command(args.out, args.run_dir)
        if args.action == "suite":
            from kvquota_lab.bench.suite import suite_command

            names = [n.strip() for n in args.scenario.split(",")] if args.scenario else None
            return suite_command(names, max(1, args.jobs), not args.no_progress,
                                 args.json, args.markdown, max(1, args.seeds),
                                 parse_overrides(args.overrides))
        return _bench(args)
    except (ScenarioError, CostProfileError, ValueError) as exc:
        print(f"kvquota bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a process of the engine backend failed (log tail inside)
        print(f"kvquota bench: {exc}", file=sys.stderr)
        return 1


def _require_extras(args: argparse.Namespace) -> None:
    """Before any work: the twin and the engine backend both run vLLM's own code; the
    plot is drawn at the end of a long run, so check for matplotlib first."""
    from kvquota.extras import require

    command = f"kvquota bench {args.action}" if args.action != "run" else "kvquota bench"
    require(command, "vllm")
    if args.plot:
        require(f"{command} --plot", "matplotlib")


def _list() -> int:
    from kvquota_lab.bench.cost import available_profiles
    from kvquota_lab.bench.scenario import shipped_scenarios

    print("scenarios:")
    for name, description in shipped_scenarios().items():
        print(f"  {name:<24} {description}")
    print("cost profiles (twin):", ", ".join(available_profiles()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvquota_lab.bench.report import format_table, write_plot
    from kvquota_lab.bench.runner import BenchOptions, run_bench
    from kvquota_lab.bench.scenario import parse_overrides

    victim_orders: tuple[str, ...] = tuple(
        v.strip() for v in args.victim_orders.split(",") if v.strip()
    )
    engine_args = {"run_dir": args.run_dir} if args.run_dir else {}
    options = BenchOptions(
        scenario=args.scenario or "noisy-neighbour",
        backend=args.backend,
        scale=args.scale,
        seed=args.seed,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        victim_orders=victim_orders,
        baseline=not args.no_baseline,
        profile=args.profile,
        progress=not args.no_progress,
        jobs=max(1, args.jobs),
        quiet=True,
        engine_args=engine_args,
        replicas=args.replicas,
        router=args.router,
        splits=tuple(s.strip() for s in args.split.split(",") if s.strip()),
        picker_signals=tuple(s.strip() for s in args.picker_signals.split(",") if s.strip()),
        picker_kv_filter=args.picker_kv_filter,
        picker_config=args.picker_config,
        pool_ledger=args.pool_ledger,
        one_engine_seeds=args.one_engine_seeds,
        overrides=parse_overrides(args.overrides),
    )
    document = run_bench(options, out=sys.stdout)
    print()
    print(format_table(document))
    if "pool" in document:
        from kvquota_lab.bench.pool_report import format_pool_table

        print(format_pool_table(document))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(document, args.plot)
        print(f"wrote {args.plot}")
    return 0
