"""Bench output: the terminal table, the JSON document and the PNG.

Everything is built from the JSON document (`build_document`), so a saved JSON can be
re-plotted and two runs can be diffed: apart from `run` (wall-clock times), the
document is a pure function of the scenario, the seed and the backend's behaviour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvquota_lab.bench.charges import charge_lines
from kvquota_lab.bench.cost import CostProfile
from kvquota_lab.bench.metrics import RunResult, summarize
from kvquota_lab.bench.scenario import TIER_ORDER, Scenario
from kvquota_lab.bench.ttft_parts import describe, tail_split

SCHEMA = "kvquota.dev/bench/v1"


def protected_tier(scenario: Scenario) -> str | None:
    """The tier the comparison is about: the highest tier that sends load and is kept
    in the baseline (premium, in the shipped scenarios)."""
    dropped = set(scenario.baseline.drop_tiers)
    for tier in TIER_ORDER:
        if tier in scenario.tiers and tier not in dropped:
            return tier.value
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def build_document(
    scenario: Scenario,
    *,
    source: str,
    scale: str | None,
    backend: str,
    profile: CostProfile | None,
    runs: list[RunResult],
    baseline: RunResult | None,
    num_sessions: int,
    num_requests: int,
) -> dict[str, Any]:
    policies = {run.key: summarize(run, scenario) for run in runs}
    all_runs = runs + ([baseline] if baseline is not None else [])
    base = summarize(baseline, scenario) if baseline is not None else None
    tier = protected_tier(scenario)
    comparison: dict[str, Any] = {"tier": tier}
    if tier is not None:
        def p99(summary: dict[str, Any] | None) -> float | None:
            if summary is None or tier not in summary["tiers"]:
                return None
            value = summary["tiers"][tier]["ttftP99"]
            return float(value) if value is not None else None

        base_p99 = p99(base)
        comparison["baselineTtftP99"] = base_p99
        comparison["ttftP99VsBaseline"] = {
            key: _ratio(p99(summary), base_p99) for key, summary in policies.items()
        }
        if baseline is not None and base_p99 is not None:
            # Where the tail above the baseline's p99 went, turn by turn against the
            # same turns alone (`bench.ttft_parts`); None: the backend cannot say.
            comparison["tailSplit"] = {
                run.key: tail_split(run.outcomes, baseline.outcomes, tier, base_p99)
                for run in runs
            }
    stock = policies.get("fcfs")
    if stock is not None:
        comparison["throughputVsFcfs"] = {
            key: _ratio(summary["throughput"], stock["throughput"])
            for key, summary in policies.items()
        }
    return {
        "schema": SCHEMA,
        "backend": backend,
        "scenario": {
            "name": scenario.name,
            "source": source,
            "scale": scale,
            "seed": scenario.seed,
            "duration": scenario.duration,
            "capacityBlocks": scenario.engine.capacity_blocks,
            "blockSize": scenario.engine.block_size,
            "sessions": num_sessions,
            "requests": num_requests,
        },
        "profile": profile.model_dump(mode="json", by_alias=True, exclude_none=True)
        if profile is not None else None,
        "policies": policies,
        "baseline": base,
        "comparison": comparison,
        "run": {
            "wallSeconds": {r.key: round(r.wall_seconds, 2) for r in all_runs},
            "cpuSeconds": {r.key: round(r.cpu_seconds, 2) for r in all_runs},
        },
    }


# -- terminal -----------------------------------------------------------------------


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s" if value < 100 else f"{value:.0f}s"


def _n(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


COLUMNS = (
    ("policy", 30), ("tier", 8), ("reqs", 6), ("TTFT p50", 9), ("p95", 8), ("p99", 8),
    ("TPOT", 7), ("tok/s", 8), ("goodput", 8), ("preempt", 8), ("outgrown", 9),
    ("above max", 10), ("prefix hit", 11),
    ("lease brk", 10), ("429", 6), ("503", 6),
)


def _row(cells: list[str], first: int) -> str:
    out = [cells[0].ljust(first), cells[1].ljust(COLUMNS[1][1])]
    out += [cell.rjust(width) for (_, width), cell in zip(COLUMNS[2:], cells[2:], strict=True)]
    return "".join(out).rstrip()


def format_table(document: dict[str, Any]) -> str:
    entries = list(document["policies"].items())
    if document.get("baseline"):
        entries.insert(0, ("baseline", document["baseline"]))
    first = max([COLUMNS[0][1] - 6] + [len(s["label"]) + 2 for _, s in entries])
    rows = [_row([name for name, _ in COLUMNS], first)]
    rows.append("-" * len(rows[0]))
    for _key, summary in entries:
        label = summary["label"]
        for tier, t in summary["tiers"].items():
            rows.append(_row([
                label, tier, str(t["requests"]), _s(t["ttftP50"]), _s(t["ttftP95"]),
                _s(t["ttftP99"]), _s(t["tpotMean"]), _n(t["throughput"], "{:.0f}"),
                _n(t["goodput"], "{:.2f}"), _n(t["preemptions"]),
                _n(t.get("outgrownPreemptions")), _n(t.get("aboveMaxPreemptions")),
                _n(t["prefixHitRate"], "{:.0%}"), _n(t["leaseBreaks"]),
                str(t["rejected429"]), str(t["rejected503"]),
            ], first))
            label = ""
    lines = ["\n".join(rows), ""]
    scenario = document["scenario"]
    lines.append(
        f"scenario {scenario['name']}"
        + (f" (scale {scenario['scale']})" if scenario.get("scale") else "")
        + f", seed {scenario['seed']}, backend {document['backend']}: "
        f"{scenario['requests']} requests in {scenario['sessions']} sessions, "
        f"{scenario['capacityBlocks']} KV blocks of {scenario['blockSize']} tokens"
    )
    comparison = document["comparison"]
    tier = comparison.get("tier")
    if tier and comparison.get("baselineTtftP99") is not None:
        ratios = ", ".join(
            f"{k} {_n(v, '{:.2f}x')}" for k, v in comparison["ttftP99VsBaseline"].items()
        )
        lines.append(
            f"{tier} TTFT p99 vs no-noise baseline ({_s(comparison['baselineTtftP99'])}): "
            f"{ratios}"
        )
    for key, split in (comparison.get("tailSplit") or {}).items():
        if split is not None:
            lines.append(f"{tier} tail ({key}): {describe(split)}")
    if "throughputVsFcfs" in comparison:
        stock = document["policies"]["fcfs"]["throughput"]
        ratios = ", ".join(
            f"{k} {_n(v, '{:.2f}x')}"
            for k, v in comparison["throughputVsFcfs"].items() if k != "fcfs"
        )
        lines.append(f"total throughput vs stock FCFS ({_n(stock, '{:.0f}')} tok/s): {ratios}")
    lines += kv_lines(document)
    lines += charge_lines(document)
    for key, summary in document["policies"].items():
        for note in summary.get("notes", []):
            lines.append(f"note ({key}): {note}")
        extra = summary.get("extra") or {}
        if extra.get("preemptionsByReason"):
            reasons = ", ".join(f"{r} {c}" for r, c in extra["preemptionsByReason"].items())
            lines.append(f"{key}: evictions by reason: {reasons}")
    wall = document["run"]["wallSeconds"]
    cpu = document["run"].get("cpuSeconds", {})
    if document["backend"] == "twin":
        lines.append("per run, wall (cpu): " + ", ".join(
            f"{k} {v:.1f}s ({cpu.get(k, 0):.1f}s)" for k, v in wall.items()
        ) + f"; cpu total {sum(cpu.values()):.1f}s")
    else:
        lines.append("per run, wall (engine start included): "
                     + ", ".join(f"{k} {v:.0f}s" for k, v in wall.items()))
    return "\n".join(lines)


def kv_lines(document: dict[str, Any]) -> list[str]:
    """Mean KV in use per policy (and KVQuota's against stock priority's), and how long
    each tenant sat at a ceiling its TenantQuota declares, on blocks it held."""
    policies = document["policies"]
    shares = {key: s.get("kvInUse") for key, s in policies.items()}
    if not any(v is not None for v in shares.values()):
        return []
    window = next(iter(policies.values())).get("loadWindowSeconds")
    prio = shares.get("priority")
    cells = []
    for key, share in shares.items():
        cell = f"{key} {_n(share, '{:.0%}')}"
        if key != "priority" and share is not None and prio:
            cell += f" ({share / prio:.2f}x priority)"
        cells.append(cell)
    lines = [f"mean KV blocks in use while load arrives (0-{_n(window, '{:.0f}')} s, share "
             "of capacity): " + ", ".join(cells)]
    for key, summary in policies.items():
        at = ceiling_times(summary)
        if at:
            lines.append(f"{key}: at a declared ceiling (blocks held, not reserved): "
                         + "; ".join(at))
    return lines


def ceiling_times(summary: dict[str, Any]) -> list[str]:
    """'acme maxBlocks 5600: 120 s' for every tenant that spent time at one."""
    out = []
    for tenant, c in (summary.get("ceilings") or {}).items():
        if (c.get("secondsAtMaxBlocks") or 0) >= 1:
            out.append(f"{tenant} ({c['tier']}) maxBlocks {c['maxBlocks']}: "
                       f"{c['secondsAtMaxBlocks']:.0f} s (peak held {c['peakHeld']})")
        if (c.get("secondsAtMaxConcurrent") or 0) >= 1:
            out.append(f"{tenant} ({c['tier']}) maxConcurrentRequests "
                       f"{c['maxConcurrentRequests']}: {c['secondsAtMaxConcurrent']:.0f} s")
    return out


# -- PNG ----------------------------------------------------------------------------

TIER_COLOURS = {"premium": "#1f77b4", "standard": "#2ca02c", "free": "#d62728",
                "all": "#7f7f7f"}  # all: stock vLLM on the engine backend (no tiers)


def write_plot(document: dict[str, Any], path: Path) -> None:
    """Top: the protected tier's TTFT CDF per policy (and the baseline, dashed).
    Below: KV blocks held per tier over time, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = document["policies"]
    tier = document["comparison"].get("tier") or "premium"
    fig = plt.figure(figsize=(12, 4 + 2.6 * len(policies)), layout="constrained")
    grid = fig.add_gridspec(1 + len(policies), 1, height_ratios=[1.6] + [1] * len(policies))
    ax = fig.add_subplot(grid[0])
    curves = list(policies.items())
    if document.get("baseline"):
        curves.append(("baseline", document["baseline"]))
    for key, summary in curves:
        points = summary["tiers"].get(tier, {}).get("ttftCdf") or []
        if not points:
            continue
        ys = [i / (len(points) - 1) for i in range(len(points))]
        ax.step(points, ys, where="post", label=summary["label"],
                linestyle="--" if key == "baseline" else "-", linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"{tier} time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    scenario = document["scenario"]
    ax.set_title(f"{scenario['name']}: {tier} TTFT CDF ({document['backend']} backend, "
                 f"{scenario['requests']} requests)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    for i, (_, summary) in enumerate(policies.items()):
        panel = fig.add_subplot(grid[1 + i])
        timeline = summary["timeline"]
        times = timeline["times"]
        series = [(t, timeline["blocks"][t]) for t in TIER_COLOURS if t in timeline["blocks"]]
        if times and series:
            panel.stackplot(times, *[values for _, values in series],
                            labels=[t for t, _ in series],
                            colors=[TIER_COLOURS[t] for t, _ in series], alpha=0.8)
        else:
            panel.text(0.5, 0.5, "no KV usage reported for this run", ha="center",
                       va="center", transform=panel.transAxes, color="grey")
        if timeline.get("capacityBlocks"):
            panel.axhline(timeline["capacityBlocks"], color="black", linewidth=0.8,
                          linestyle=":", label="capacity")
        panel.set_ylabel("KV blocks")
        panel.set_title(f"{summary['label']}: KV blocks held per tier (running + leased)",
                        fontsize=10)
        panel.grid(True, alpha=0.3)
        panel.legend(loc="upper right", fontsize=8)
        if i == len(policies) - 1:
            panel.set_xlabel("time (s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
