"""`kvquota bench suite`: every shipped scenario at its default and `a100-40gb` scales,
against the targets KVQuota is judged by, in one table with PASS/FAIL.

Targets, per scenario and scale (twin backend; stock = vLLM's own schedulers):

- `p99/base`: the protected tier's (premium's) TTFT p99 at most 1.5x its no-noise
  baseline (the scenario without its `baseline.dropTiers`); no baseline: not judged.
  The detail names the largest cause of the tail above the baseline's p99
  (`bench.ttft_parts`), and the diagnosis gives the whole split. Above 1.5x it is
  BOUND, not failed, when its demand passed its declared ceiling: a tenant of the tier
  held its own maxBlocks for at least half the load window, or the tail's largest
  cause is the sidecar and the tier queued there mostly on its own maxBlocks; the
  check says for how long;
- `p99/prio`: and no worse than stock vLLM priority's;
- `in-guar`: zero 429/503 refusals of a request that fitted within its tenant's
  guaranteed blocks;
- `goodput`: every other tier's goodput at least 0.9x stock priority's; in a scenario
  with no other tier, the protected tier's goodput at least stock priority's. A tier
  below that passes as BOUND when one of its tenants spent at least half the load
  window at a ceiling its own TenantQuota declares, measured on what it held
  (`occupancy`: blocks held >= 90% of maxBlocks, or maxConcurrentRequests in flight);
  the table names that limit;
- `kv-use`: KVQuota's mean KV blocks in use while load arrives at least 0.9x stock
  priority's (a policy that reserves more than requests hold leaves the cache idle);
- `idle-kv`: no tier waited more than 2% of its queued seconds on its own maxBlocks
  while the blocks it asked for were free above the watermark and no one else waited
  for them ("waited beside idle KV");
- `tput`: total throughput at least 1.0x stock FCFS; `tput/prio`: at least 0.95x
  stock priority.

Ties: the twin advances in engine steps, so a time it reports is resolved to one step
and no finer. `p99/prio` and `tput` compare two runs' times; KVQuota's is judged equal
to stock's when they differ by less than one of its run's mean steps (makespan /
steps: about 20-60 ms in the shipped scenarios). The table shows the ratio as measured and
marks such a result TIE.

Every twin run is deterministic, so the table is the same on any machine; all runs go
to one process pool (`--jobs`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from kvquota_lab.bench.cost import load_profile
from kvquota_lab.bench.metrics import RunResult
from kvquota_lab.bench.report import build_document
from kvquota_lab.bench.runner import ProgressBar, _baseline_scenario
from kvquota_lab.bench.scenario import Scenario, generate_sessions, load_scenario, scenario_scales
from kvquota_lab.bench.ttft_parts import describe

SUITE_SCALES: tuple[str | None, ...] = (None, "a100-40gb")
P99_VS_BASELINE = 1.5
GOODPUT_VS_PRIORITY = 0.9
THROUGHPUT_VS_FCFS = 1.0
THROUGHPUT_VS_PRIORITY = 0.95
KV_USE_VS_PRIORITY = 0.9
# Of a tier's queued seconds, at most this share waited on its own maxBlocks beside KV
# nobody else wanted (free above the watermark, no one else waiting).
BESIDE_IDLE_KV_SHARE = 0.02
# A tier "spent the run at a ceiling" when a tenant of it sat there for at least this
# share of the load window.
CEILING_RUN_SHARE = 0.5
POLICIES = ("fcfs", "priority", "kvquota")


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not applicable
    value: str
    detail: str = ""
    tie: bool = False  # passed as a tie (within one twin step)
    bound: str = ""  # missed the ratio, excused by this declared limit (goodput)

    def verdict(self, fail: str = "FAIL") -> str:
        if self.passed and self.bound:
            return "BOUND"
        return "TIE" if self.tie else "PASS" if self.passed else fail


@dataclass
class CaseResult:
    scenario: str
    scale: str
    document: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    seed: int | None = None  # None: the scenario's own

    @property
    def label(self) -> str:
        return self.scale if self.seed is None else f"{self.scale} s{self.seed}"

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)


def _tiers(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tiers: dict[str, dict[str, Any]] = summary["tiers"]
    return tiers


def evaluate(document: dict[str, Any]) -> list[Check]:
    """The targets of the module docstring, judged on one bench document."""
    policies = document["policies"]
    ours, prio, fcfs = policies["kvquota"], policies["priority"], policies["fcfs"]
    tier = document["comparison"].get("tier") or "premium"
    checks: list[Check] = []
    step = ours["makespan"] / ours["steps"] if ours.get("steps") else 0.0
    ours_p99 = _tiers(ours).get(tier, {}).get("ttftP99")
    prio_p99 = _tiers(prio).get(tier, {}).get("ttftP99")
    ratio = document["comparison"].get("ttftP99VsBaseline", {}).get("kvquota")
    if ratio is None:
        checks.append(Check("p99/base", None, "n/a", "no baseline (nothing to drop)"))
    else:
        checks.append(_vs_baseline(document, tier, ratio))
    if ours_p99 is not None and prio_p99:
        checks.append(_at_most("p99/prio", ours_p99, prio_p99, step,
                               f"{ours_p99 / prio_p99:.2f}x", f"stock priority {prio_p99:.3g}s"))
    refused = sum(t.get("refusedWithinGuarantee", 0) for t in _tiers(ours).values())
    checks.append(Check("in-guar", refused == 0, str(refused)))
    others = [t for t in _tiers(ours) if t != tier]
    ratios: list[tuple[str, float]] = []
    for other in others or [tier]:
        mine, theirs = _tiers(ours)[other]["goodput"], _tiers(prio).get(other, {}).get("goodput")
        if mine is not None and theirs:
            ratios.append((other, mine / theirs))
    bound = GOODPUT_VS_PRIORITY if others else 1.0
    if ratios:
        checks.append(_goodput(ours, ratios, bound, bool(others)))
    ours_kv, prio_kv = ours.get("kvInUse"), prio.get("kvInUse")
    if ours_kv is not None and prio_kv:
        kv = ours_kv / prio_kv
        checks.append(Check("kv-use", kv >= KV_USE_VS_PRIORITY, f"{kv:.2f}x",
                            f"KV in use {ours_kv:.0%}, stock priority {prio_kv:.0%}"))
    idle = _beside_idle_kv(ours)
    if idle is not None:
        checks.append(idle)
    # Throughput is output tokens / makespan: KVQuota's makespan against the time the
    # stock policy's throughput (times the target) needs for the same tokens.
    for name, stock, target in (("tput", fcfs, THROUGHPUT_VS_FCFS),
                                ("tput/prio", prio, THROUGHPUT_VS_PRIORITY)):
        if stock["throughput"]:
            stock_time = ours["outputTokens"] / (stock["throughput"] * target)
            check = _at_most(name, ours["makespan"], stock_time, step,
                             f"{ours['throughput'] / stock['throughput']:.3f}x")
            if check.passed is False:
                check.detail = "; ".join(filter(None, (check.detail,
                                                       _cut_answers(ours, stock))))
            checks.append(check)
    return checks


def _vs_baseline(document: dict[str, Any], tier: str, ratio: float) -> Check:
    """The protected tier's p99 against its no-noise baseline, with the largest cause
    of its tail (`bench.ttft_parts`). Above the target it is BOUND, not failed, when a
    tenant of the tier held its own maxBlocks for most of the load window: its demand
    passed what its TenantQuota declares."""
    ours = document["policies"]["kvquota"]
    detail = (f"{tier} TTFT p99 {_tiers(ours)[tier]['ttftP99']:.3g}s, baseline "
              f"{document['comparison']['baselineTtftP99']:.3g}s")
    split = (document["comparison"].get("tailSplit") or {}).get("kvquota")
    if split and split["turns"] and split["overAloneSeconds"] > 0:
        dominant = split["dominant"]
        share = split["seconds"][dominant] / split["overAloneSeconds"]
        detail += f"; tail mostly {dominant} ({share:.0%})"
    if ratio <= P99_VS_BASELINE:
        return Check("p99/base", True, f"{ratio:.2f}x", detail)
    limit = _ceiling_of(ours, tier, ("maxBlocks",)) or _queued_on_own_quota(ours, tier, split)
    if limit:
        return Check("p99/base", True, f"{ratio:.2f}x", f"{detail}; {tier} at {limit}",
                     bound=f"{tier} at {limit}")
    return Check("p99/base", False, f"{ratio:.2f}x", detail)


def _queued_on_own_quota(summary: dict[str, Any], tier: str,
                         split: dict[str, Any] | None) -> str:
    """'' unless the tail's largest cause is the sidecar and the tier queued there
    mostly on its own maxBlocks: its demand passed its declared ceiling. Names the
    seconds queued on it and each tenant's time holding it."""
    if not split or split.get("dominant") != "sidecar":
        return ""
    queued = _tiers(summary)[tier].get("queuedSecondsBy") or {}
    own = queued.get("rejected_quota", 0.0)
    if not own or own < 0.5 * sum(queued.values()):
        return ""
    window = summary.get("loadWindowSeconds") or 0.0
    held = ", ".join(
        f"{tenant}'s {c['maxBlocks']} held for {c.get('secondsAtMaxBlocks') or 0:.0f} s "
        f"of {window:.0f} s"
        for tenant, c in (_tiers(summary)[tier].get("atCeiling") or {}).items())
    return (f"its maxBlocks: tail mostly in the sidecar, {own:.0f} s queued on its own "
            f"maxBlocks" + (f" ({held})" if held else ""))


def _beside_idle_kv(summary: dict[str, Any]) -> Check | None:
    """The worst tier's seconds waited on its maxBlocks beside idle KV, as a share of
    all its queued seconds (None: the run does not report it)."""
    shares: list[tuple[str, float, float]] = []
    for tier, t in _tiers(summary).items():
        idle = t.get("besideIdleKvSeconds")
        if idle is None:
            return None
        queued = sum((t.get("queuedSecondsBy") or {}).values())
        shares.append((tier, idle, idle / queued if queued else 0.0))
    if not shares:
        return None
    tier, idle, share = max(shares, key=lambda s: s[2])
    return Check("idle-kv", share <= BESIDE_IDLE_KV_SHARE, f"{share:.1%}",
                 f"{tier} waited {idle:.0f} s on its maxBlocks beside idle KV")


def _cut_answers(summary: dict[str, Any], stock: dict[str, Any]) -> str:
    """Output KVQuota did not generate because admission clamped max_tokens to a tier's
    ceiling (stock vLLM generates what the client asked for): fewer tokens in about
    the same time is lower throughput, and the ceiling is the declared limit that binds."""
    cut = []
    for tier, t in summary["tiers"].items():
        if t.get("tokensCutAtMaxTokens"):
            ceilings = {c.get("maxTokens") for c in (t.get("atCeiling") or {}).values()}
            limit = "/".join(str(m) for m in sorted(ceilings) if m) or "?"
            cut.append(f"{tier} {t['answersCutAtMaxTokens']} answers cut at maxTokens "
                       f"{limit} ({t['tokensCutAtMaxTokens']:,} tokens)")
    if not cut:
        return ""
    same = "the same requests" if summary["completed"] == stock["completed"] else (
        f"{summary['completed']} requests (stock: {stock['completed']})")
    return (", ".join(cut) + f"; {same} done in {summary['makespan']:.0f} s, "
            f"{stock['label']} in {stock['makespan']:.0f} s")


def _goodput(ours: dict[str, Any], ratios: list[tuple[str, float]], bound: float,
             others: bool) -> Check:
    """The worst tier's ratio; a tier below `bound` that sat at a ceiling of its own
    for most of the run is excused, and the check names the limit."""
    worst = min(ratios, key=lambda r: r[1])
    detail = ", ".join(f"{t} {r:.2f}x" for t, r in ratios)
    missed = [t for t, r in ratios if r < bound]
    if not missed:
        return Check("goodput", True, f"{worst[1]:.2f}x", detail)
    limits = {t: _ceiling_of(ours, t) for t in missed} if others else {}
    if missed and all(limits.get(t) for t in missed):
        named = "; ".join(f"{t} at {limits[t]}" for t in missed)
        return Check("goodput", True, f"{worst[1]:.2f}x", f"{detail}; {named}",
                     bound=named)
    return Check("goodput", False, f"{worst[1]:.2f}x", detail)


def _ceiling_of(summary: dict[str, Any], tier: str,
                limits: tuple[str, ...] = ("maxBlocks", "maxConcurrentRequests")) -> str:
    """The declared limit (of `limits`) a tenant of `tier` sat at for at least
    CEILING_RUN_SHARE of the load window, on blocks held ('' if none did)."""
    window = summary.get("loadWindowSeconds") or 0.0
    for tenant, c in (summary["tiers"].get(tier, {}).get("atCeiling") or {}).items():
        for limit, seconds in (("maxBlocks", c.get("secondsAtMaxBlocks")),
                               ("maxConcurrentRequests", c.get("secondsAtMaxConcurrent"))):
            if limit not in limits:
                continue
            if window and seconds and seconds >= CEILING_RUN_SHARE * window:
                return (f"{tenant}'s {limit} {c[limit]} for {seconds:.0f} s of "
                        f"{window:.0f} s")
    return ""


def _at_most(name: str, ours: float, stock: float, step: float, value: str,
             detail: str = "") -> Check:
    """`ours` <= `stock`, a difference under one twin step counting as a tie."""
    if ours <= stock:
        return Check(name, True, value, detail)
    tie = ours - stock < step
    note = f"{(ours - stock) * 1000:.1f} ms more, under one step ({step * 1000:.1f} ms)"
    return Check(name, tie, value, "; ".join(filter(None, (detail, note if tie else ""))), tie)


def diagnosis(document: dict[str, Any]) -> str:
    """What to look at first when a target is missed: hit rates, refusals, evictions."""
    tier = document["comparison"].get("tier") or "premium"
    ours = _tiers(document["policies"]["kvquota"])
    base = _tiers(document["baseline"]) if document.get("baseline") else {}
    parts = []
    mine = ours.get(tier, {})
    hit, base_hit = mine.get("prefixHitRate"), base.get(tier, {}).get("prefixHitRate")
    if hit is not None:
        parts.append(f"{tier} prefix hit {hit:.0%}"
                     + (f" (baseline {base_hit:.0%})" if base_hit is not None else ""))
    if mine.get("tpotMean") is not None:
        parts.append(f"{tier} TPOT {mine['tpotMean'] * 1000:.0f}ms")
    for name, t in ours.items():
        if t["rejected429"] or t["rejected503"]:
            parts.append(f"{name} refused 429x{t['rejected429']} 503x{t['rejected503']}")
        waited = t.get("queuedSecondsBy") or {}
        if sum(waited.values()) >= 1.0:
            parts.append(f"{name} queued " + ", ".join(
                f"{seconds:.0f}s on {_WAITED_ON.get(reason, reason)}"
                for reason, seconds in sorted(waited.items(), key=lambda x: -x[1])))
        if t.get("gaveUp"):
            parts.append(f"{name} gave up {t['gaveUp']}")
    extra = document["policies"]["kvquota"].get("extra") or {}
    if extra.get("preemptionsByReason"):
        parts.append("evictions " + ", ".join(
            f"{r} {c}" for r, c in extra["preemptionsByReason"].items()))
    capped = (extra.get("leaseDrops") or {}).get("cap")
    if capped:
        parts.append(f"leases dropped for lease caps {capped}")
    above = {name: t.get("aboveMaxPreemptions") for name, t in ours.items()}
    if any(above.values()):
        parts.append("preempted beyond maxBlocks " + ", ".join(
            f"{name} {count}" for name, count in above.items() if count))
    outgrown = {name: t.get("outgrownPreemptions") for name, t in ours.items()}
    if any(outgrown.values()):
        parts.append("preempted past their estimate " + ", ".join(
            f"{name} {count}" for name, count in outgrown.items() if count))
    parts += binding_limits(document["policies"]["kvquota"])
    split = (document["comparison"].get("tailSplit") or {}).get("kvquota")
    if split and split["turns"]:
        parts.append(f"{tier} tail: {describe(split)}")
    return "; ".join(parts)


def binding_limits(summary: dict[str, Any]) -> list[str]:
    """Per tenant, the declared limits it met: how long it held blocks at maxBlocks
    (or had maxConcurrentRequests in flight), and, when its tier queued on maxBlocks
    while it held far less, that reservations, not held blocks, reached the quota."""
    out = []
    window = summary.get("loadWindowSeconds") or 0.0
    for tier, t in summary["tiers"].items():
        queued_quota = (t.get("queuedSecondsBy") or {}).get("rejected_quota", 0.0)
        for tenant, c in (t.get("atCeiling") or {}).items():
            held_at = c.get("secondsAtMaxBlocks") or 0.0
            if held_at >= 1.0:
                out.append(f"{tenant} ({tier}) held its maxBlocks {c['maxBlocks']} for "
                           f"{held_at:.0f} s of {window:.0f} s")
            elif queued_quota >= 1.0:
                out.append(f"{tenant} ({tier}) queued on its maxBlocks {c['maxBlocks']} "
                           f"while holding at most {c['peakHeld']}: reservations, not "
                           "held blocks, reached it")
            concurrent_at = c.get("secondsAtMaxConcurrent") or 0.0
            if concurrent_at >= 1.0:
                out.append(f"{tenant} ({tier}) had its maxConcurrentRequests "
                           f"{c['maxConcurrentRequests']} in flight for "
                           f"{concurrent_at:.0f} s")
    return out


# What a queued request waited on (`admission.Decision`), as the diagnosis says it.
_WAITED_ON = {
    "rejected_quota": "its maxBlocks",
    "rejected_concurrency": "its maxConcurrentRequests",
    "rejected_watermark": "the KV watermark",
}


def suite_cases(names: list[str] | None = None) -> list[tuple[str, str | None]]:
    from kvquota_lab.bench.scenario import shipped_scenarios

    cases = []
    for name in names or list(shipped_scenarios()):
        scales = scenario_scales(name)
        cases += [(name, scale) for scale in SUITE_SCALES if scale is None or scale in scales]
    return cases


def run_suite(
    names: list[str] | None = None, *, jobs: int = 2, progress: bool = True,
    seeds: int = 1, out: TextIO = sys.stdout, overrides: dict[str, Any] | None = None,
) -> list[CaseResult]:
    """Run every case; with `seeds` > 1 each case also runs with the next seeds (new
    sessions from the same distributions: the same targets on unseen workloads).
    `overrides` (`--set`) is merged into every scenario, e.g. a tier's reservation."""
    from kvquota_lab.bench.policies import BASELINE
    from kvquota_lab.bench.policies import POLICIES as SPECS
    from kvquota_lab.bench.tasks import TwinTask, run_twin_tasks

    cases: list[tuple[str, str | None, Scenario, Scenario | None, int | None]] = []
    for name, scale in suite_cases(names):
        scenario = load_scenario(name, scale=scale, overrides=overrides)
        for offset in range(seeds):
            seed = scenario.seed + offset if seeds > 1 else None
            case = (load_scenario(name, scale=scale, seed=seed, overrides=overrides)
                    if seed is not None else scenario)
            cases.append((name, scale, case, _baseline_scenario(case), seed))
    profiles = {scenario.profile for _, _, scenario, _, _ in cases}
    if len(profiles) != 1:
        raise ValueError(f"the suite runs one cost profile at a time, got {sorted(profiles)}")
    profile = load_profile(profiles.pop())
    # One pool for every run; each run's key names its case, for the progress bar.
    tasks: list[TwinTask] = []
    for name, scale, scenario, base, seed in cases:
        prefix = f"{name}@{scale or 'default'}@{seed}"
        planned = [(scenario, SPECS[p]) for p in POLICIES]
        if base is not None:
            planned.append((base, BASELINE))
        tasks += [(s, replace(spec, key=f"{prefix}:{spec.key}")) for s, spec in planned]
    out.write(f"kvquota bench suite: {len(cases)} cases, {len(tasks)} twin runs, "
              f"{jobs} jobs" + (f", with {overrides}" if overrides else "") + "\n")
    out.flush()
    results = run_twin_tasks(tasks, profile, jobs=jobs,
                             progress=ProgressBar(len(tasks), enabled=progress), quiet=True)
    by_key: dict[str, RunResult] = {}
    for result in results:
        full_key = result.key
        result.key = full_key.rsplit(":", 1)[1]
        by_key[full_key] = result
    outcome: list[CaseResult] = []
    for name, scale, scenario, base, seed in cases:
        prefix = f"{name}@{scale or 'default'}@{seed}"
        runs = [by_key[f"{prefix}:{p}"] for p in POLICIES]
        baseline = by_key.get(f"{prefix}:baseline") if base is not None else None
        sessions = generate_sessions(scenario)
        document = build_document(
            scenario, source=name, scale=scale, backend="twin", profile=profile, runs=runs,
            baseline=baseline, num_sessions=len(sessions),
            num_requests=sum(len(s.turns) for s in sessions),
        )
        outcome.append(CaseResult(name, scale or "default", document, evaluate(document),
                                  seed))
    return outcome


TARGET_NAMES = ("p99/base", "p99/prio", "in-guar", "goodput", "kv-use", "idle-kv", "tput",
                "tput/prio")


def format_suite(results: list[CaseResult]) -> str:
    widths = [24, 14] + [12] * len(TARGET_NAMES) + [6]
    header = ["scenario", "scale", *TARGET_NAMES, "all"]
    lines = ["".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("-" * len(lines[0]))
    for case in results:
        by_name = {c.name: c for c in case.checks}
        cells = [case.scenario, case.label]
        for name in TARGET_NAMES:
            check = by_name.get(name)
            if check is None or check.passed is None:
                cells.append("n/a")
            else:
                cells.append(f"{check.value} {check.verdict()}")
        cells.append("PASS" if case.passed else "FAIL")
        lines.append("".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    passed = sum(c.passed for c in results)
    lines.append(f"{passed}/{len(results)} cases meet every target")
    for case in results:
        failed = [c for c in case.checks if c.passed is False]
        if failed:
            lines.append(f"  {case.scenario}@{case.label}: " + _explained(failed)
                         + f" -- {diagnosis(case.document)}")
    for case in results:
        ties = [c for c in case.checks if c.tie]
        if ties:
            lines.append(f"  {case.scenario}@{case.label}: TIE " + _explained(ties))
    for case in results:
        bound = [c for c in case.checks if c.passed and c.bound]
        if bound:
            lines.append(f"  {case.scenario}@{case.label}: BOUND " + _explained(bound))
    return "\n".join(lines)


def _explained(checks: list[Check]) -> str:
    return "; ".join(f"{c.name} {c.value} ({c.detail})" if c.detail else f"{c.name} {c.value}"
                     for c in checks)


def format_markdown(results: list[CaseResult]) -> str:
    lines = ["# KVQuota bench suite (twin)", "",
             "| scenario | scale | " + " | ".join(TARGET_NAMES) + " | all |",
             "|---|---|" + "---|" * (len(TARGET_NAMES) + 1)]
    for case in results:
        by_name = {c.name: c for c in case.checks}
        cells = []
        for name in TARGET_NAMES:
            check = by_name.get(name)
            cells.append("n/a" if check is None or check.passed is None
                         else f"{check.value} {check.verdict('**FAIL**')}")
        lines.append(f"| {case.scenario} | {case.label} | " + " | ".join(cells)
                     + f" | {'PASS' if case.passed else '**FAIL**'} |")
    lines += ["", "## Per case", ""]
    for case in results:
        lines.append(f"- **{case.scenario} @ {case.label}**: " + "; ".join(
            f"{c.name} {c.value}" + (f" ({c.detail})" if c.detail else "") for c in case.checks
        ) + f". {diagnosis(case.document)}.")
    return "\n".join(lines) + "\n"


def suite_command(names: list[str] | None, jobs: int, progress: bool,
                  json_path: Path | None, markdown_path: Path | None, seeds: int = 1,
                  overrides: dict[str, Any] | None = None) -> int:
    results = run_suite(names, jobs=jobs, progress=progress, seeds=seeds,
                        overrides=overrides)
    print()
    print(format_suite(results))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([
            {"scenario": c.scenario, "scale": c.scale, "seed": c.seed, "passed": c.passed,
             "checks": [c2.__dict__ for c2 in c.checks], "document": c.document}
            for c in results
        ], indent=2) + "\n")
        print(f"wrote {json_path}")
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(format_markdown(results))
        print(f"wrote {markdown_path}")
    return 0 if all(c.passed for c in results) else 1
