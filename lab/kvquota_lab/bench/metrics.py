"""What one policy run measured, and the per-tier summary every report shows.

Both backends fill the same records: one `Outcome` per turn a client sent (however
many attempts it took), a KV-usage timeline and the plugin's lease counters. TTFT is
measured from the turn's *first* attempt, so a request the gateway refused and the
client retried pays for the wait, as its user would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine_sidecar.contract.policy import Tier
from kvquota_lab.bench.occupancy import Occupancy
from kvquota_lab.bench.scenario import TIER_ORDER, Scenario
from kvquota_lab.percentile import percentile

if TYPE_CHECKING:
    from kvquota_lab.bench.ttft_parts import TtftParts

Status = Literal["ok", "rejected", "failed", "unfinished"]
CDF_POINTS = 101


@dataclass(slots=True)
class Outcome:
    tenant: str
    tier: str
    session: str
    turn: int  # 1-based
    arrival: float  # seconds into the run, first attempt
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    # Engine backend, the admitted attempt: when it was sent and when the response
    # headers came back (the sidecar and vLLM's front end done, the engine not yet).
    sent: float | None = None
    headers: float | None = None
    server_timing: dict[str, float] = field(default_factory=dict)  # the sidecar's, in ms
    preemptions: int = 0
    attempts: int = 0
    rejections: list[int] = field(default_factory=list)  # HTTP status per refused attempt
    refused_within_guarantee: int = 0  # 429/503 refusals of an attempt that fit the guarantee
    queued_seconds: float = 0.0  # time the admitted attempt waited in the sidecar's queue
    # Output tokens the answer lost to the tier's maxTokens ceiling (KVQuota clamps the
    # client's max_tokens; stock vLLM does not).
    cut_tokens: int = 0
    # Seconds every attempt waited in the sidecar's queue, by what it waited on (the
    # tenant's own quota or concurrency limit, or the KV watermark).
    waited_on: dict[str, float] = field(default_factory=dict)
    status: Status = "unfinished"
    # Where its TTFT went (`bench.ttft_parts`); None: the backend cannot see the steps.
    ttft_parts: TtftParts | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finish is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class Timeline:
    """KV blocks held per tier (running requests + leases) sampled over time."""

    times: list[float] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    capacity: int = 0

    def add(self, time: float, by_tier: dict[str, int]) -> None:
        self.times.append(time)
        for tier in set(self.blocks) | set(by_tier):
            series = self.blocks.setdefault(tier, [0] * (len(self.times) - 1))
            series.append(by_tier.get(tier, 0))


@dataclass
class RunResult:
    key: str  # fcfs, priority, kvquota, baseline, kvquota:<variant>
    label: str
    outcomes: list[Outcome]
    timeline: Timeline
    lease_breaks: dict[str, int] = field(default_factory=dict)  # by tier; None: stock
    has_leases: bool = False
    # Preemptions per tier when the backend cannot attribute them to requests (the
    # engine backend: from the plugin's stats); None: count them from the outcomes.
    preemptions_by_tier: dict[str, int] | None = None
    preemptions_known: bool = True
    prefix_known: bool = True  # False: the backend could not see cached prompt tokens
    makespan: float = 0.0  # seconds from 0 to the last finish
    steps: int = 0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific counters
    # KV in use over the load window and time at declared ceilings (`occupancy`);
    # None: the backend could not see the engine's blocks.
    occupancy: Occupancy | None = None
    # Preemptions of requests that decoded past their reserved output estimate, per
    # tier, from the plugin's stats; None: not a KVQuota run.
    outgrown_by_tier: dict[str, int] | None = None
    # Preemptions of work beyond its tenant's maxBlocks, per tier; None: not KVQuota.
    above_max_by_tier: dict[str, int] | None = None
    # Seconds queued requests waited on their tenant's maxBlocks while the blocks they
    # asked for sat idle above the watermark and nobody else waited, per tier.
    beside_idle_kv: dict[str, float] | None = None


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def cdf(values: list[float]) -> list[float]:
    """`CDF_POINTS` quantiles (0..100%) — a compact curve for JSON and plots."""
    if not values:
        return []
    return [round(percentile(values, q) or 0.0, 4)
            for q in (i * 100 / (CDF_POINTS - 1) for i in range(CDF_POINTS))]


def tier_summary(
    outcomes: list[Outcome], scenario: Scenario, tier: str, makespan: float,
    lease_breaks: int | None, preemptions: int | None = -1, prefix_known: bool = True,
) -> dict[str, Any]:
    """One tier's numbers; `preemptions` -1 means: sum them over the outcomes."""
    mine = [o for o in outcomes if o.tier == tier]
    done = [o for o in mine if o.status == "ok"]
    ttfts = [t for o in done if (t := o.ttft) is not None]
    tpots = [t for o in done if (t := o.tpot) is not None]
    output_tokens = sum(o.output_tokens for o in done)
    followups = [o for o in done if o.turn > 1]
    follow_prompt = sum(o.prompt_tokens for o in followups)
    all_prompt = sum(o.prompt_tokens for o in done)
    slo = scenario.slo.get(Tier(tier))
    good = len(done)
    if slo is not None:
        good = sum(
            1 for o in done
            if (o.ttft or 0.0) <= slo.ttft and (o.tpot is None or o.tpot <= slo.tpot)
        )
    rejected = [status for o in mine for status in o.rejections]
    span = makespan if makespan > 0 else float("nan")
    return {
        "requests": len(mine),
        "completed": len(done),
        "gaveUp": sum(1 for o in mine if o.status == "rejected"),
        "failed": sum(1 for o in mine if o.status == "failed"),
        "unfinished": sum(1 for o in mine if o.status == "unfinished"),
        "ttftP50": _r(percentile(ttfts, 50)),
        "ttftP95": _r(percentile(ttfts, 95)),
        "ttftP99": _r(percentile(ttfts, 99)),
        "ttftMax": _r(max(ttfts, default=None)),
        "tpotMean": _r(sum(tpots) / len(tpots) if tpots else None, 5),
        "tpotP99": _r(percentile(tpots, 99), 5),
        "outputTokens": output_tokens,
        "throughput": _r(output_tokens / span, 2) if makespan > 0 else None,
        "goodput": _r(good / span, 4) if makespan > 0 else None,
        "sloAttainment": _r(good / len(done), 4) if done else None,
        "preemptions": sum(o.preemptions for o in mine) if preemptions == -1 else preemptions,
        "prefixHitRate": _r(sum(o.cached_tokens for o in followups) / follow_prompt)
        if follow_prompt and prefix_known else None,
        "prefixHitRateAll": _r(sum(o.cached_tokens for o in done) / all_prompt)
        if all_prompt and prefix_known else None,
        "leaseBreaks": lease_breaks,
        "rejected429": sum(1 for s in rejected if s == 429),
        "rejected503": sum(1 for s in rejected if s == 503),
        "refusedWithinGuarantee": sum(o.refused_within_guarantee for o in mine),
        "queuedP99": _r(percentile([o.queued_seconds for o in done], 99)),
        "answersCutAtMaxTokens": sum(1 for o in done if o.cut_tokens),
        "tokensCutAtMaxTokens": sum(o.cut_tokens for o in done),
        "queuedSecondsBy": _waited_on(mine),
        "ttftCdf": cdf(ttfts),
    }


def _waited_on(outcomes: list[Outcome]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for outcome in outcomes:
        for reason, seconds in outcome.waited_on.items():
            totals[reason] = totals.get(reason, 0.0) + seconds
    return {reason: round(seconds, 1) for reason, seconds in sorted(totals.items())}


def summarize(run: RunResult, scenario: Scenario) -> dict[str, Any]:
    """The deterministic part of a run (no wall time) as JSON-ready data."""
    tiers = [t.value for t in TIER_ORDER if any(o.tier == t.value for o in run.outcomes)]
    def preemptions(tier: str) -> int | None:
        if not run.preemptions_known:
            return None
        if run.preemptions_by_tier is not None:
            return run.preemptions_by_tier.get(tier, 0)
        return -1

    by_tier = {
        tier: tier_summary(
            run.outcomes, scenario, tier, run.makespan,
            run.lease_breaks.get(tier, 0) if run.has_leases else None, preemptions(tier),
            run.prefix_known,
        )
        for tier in tiers
    }
    occupancy: dict[str, Any] = (
        run.occupancy.to_json() if run.occupancy is not None
        else {"kvInUse": None, "loadWindowSeconds": scenario.duration,
                       "ceilings": None}
    )
    for tier, summary in by_tier.items():
        summary["outgrownPreemptions"] = (
            None if run.outgrown_by_tier is None else run.outgrown_by_tier.get(tier, 0)
        )
        summary["aboveMaxPreemptions"] = (
            None if run.above_max_by_tier is None else run.above_max_by_tier.get(tier, 0)
        )
        summary["besideIdleKvSeconds"] = (
            None if run.beside_idle_kv is None else _r(run.beside_idle_kv.get(tier, 0.0), 1)
        )
        ceilings = occupancy["ceilings"]
        summary["atCeiling"] = None if ceilings is None else {
            tenant: c for tenant, c in ceilings.items() if c["tier"] == tier
        }
    done = [o for o in run.outcomes if o.status == "ok"]
    output_tokens = sum(o.output_tokens for o in done)
    return {
        "label": run.label,
        "makespan": _r(run.makespan, 3),
        "steps": run.steps,
        "requests": len(run.outcomes),
        "completed": len(done),
        "outputTokens": output_tokens,
        "throughput": _r(output_tokens / run.makespan, 2) if run.makespan > 0 else None,
        "preemptions": (
            sum(t["preemptions"] for t in by_tier.values())
            if run.preemptions_known else None
        ),
        "kvInUse": occupancy["kvInUse"],
        "loadWindowSeconds": occupancy["loadWindowSeconds"],
        "ceilings": occupancy["ceilings"],
        "tiers": by_tier,
        "timeline": {
            "capacityBlocks": run.timeline.capacity,
            "times": [round(t, 3) for t in run.timeline.times],
            "blocks": dict(sorted(run.timeline.blocks.items())),
        },
        "extra": run.extra,
        "notes": list(run.notes),
    }
