"""The demo's verdict: what KVQuota protected, by which mechanism, and whether this run
could show it at all.

A TTFT ratio only means something if the premium follow-ups on stock vLLM really met
the burst. Two measures, both taken inside the run, decide that:

- held: every follow-up was sent while the free burst held the cache (the load
  generator waits for it, bounded; a turn sent after the bound counts as not held);
- waited: on stock vLLM (FCFS) the typical follow-up was served after free requests
  that had queued before it (they got their first token while it waited for its own).
  This is an order, not a duration, so it does not depend on the machine's speed: if it
  fails, the burst did not stand between premium and the engine, whatever the TTFTs.

- headroom: the difference is larger than what the machine itself adds. While each
  round's turns were in flight the load generator timed its own event loop's
  wake-ups. A follow-up with KVQuota crosses two event loops of ours on this machine,
  the load generator's and the sidecar's (the second only in that run), and a stall
  as long as the latest one measured could hit each in turn: a difference between the
  two p99s no larger than twice that, in either run, is not reported as a result.
  (Health checks of vLLM or the sidecar would not do: on stock the burst itself keeps
  vLLM's API server busy, which is part of the effect.)

If any fails the verdict names the measure instead of printing a misleading ratio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvquota_lab.percentile import percentile
from kvquota_lab.summary import FREE, PREMIUM, PREMIUM_FIRST, TierSummary

POLICY_RUN, STOCK_RUN = "KVQuota (policy on)", "stock vLLM (FCFS)"
# Event loops of ours a follow-up crosses with KVQuota: the load generator's, the sidecar's.
STALLS_PER_TURN = 2


@dataclass(frozen=True)
class Verdict:
    shown: bool
    protected: bool  # shown, and premium follow-ups were faster with KVQuota
    ratio: float | None  # premium follow-up TTFT p99, KVQuota / stock (only when shown)
    findings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why the run could not show it

    def lines(self) -> list[str]:
        if not self.shown:
            head = "verdict: this run cannot show the effect, so no TTFT ratio is printed:"
            return [head, *(f"  - {p}" for p in self.problems), "mechanisms seen anyway:",
                    *(f"  - {f}" for f in self.findings)]
        head = ("verdict: KVQuota protected the premium tier from the free-tier burst"
                if self.protected else
                "verdict: KVQuota did NOT make premium faster on this run")
        tail = f"premium follow-up TTFT p99 with KVQuota: {self.ratio:.2f}x of stock vLLM"
        return [head, *(f"  - {f}" for f in self.findings), tail]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _answered(run: str, s: TierSummary, expected: int) -> list[str]:
    problems = []
    if len(s.ttfts) < expected:
        problems.append(f"{run}: {len(s.ttfts)} of {expected} premium follow-ups answered "
                        f"({s.rejected_quota} x 429, {s.rejected_watermark} x 503, "
                        f"{s.failed} failed)")
    if s.held < s.sent:
        problems.append(f"{run}: the free burst held the cache for {s.held} of {s.sent} "
                        "follow-ups only (the others were sent after the wait's bound)")
    return problems


def judge(runs: dict[str, dict[str, TierSummary]], *, expected_follow_ups: int) -> Verdict:
    on, stock = runs[POLICY_RUN], runs[STOCK_RUN]
    on_p, stock_p = on.get(PREMIUM, TierSummary(PREMIUM)), stock.get(PREMIUM, TierSummary(PREMIUM))
    problems = [*_answered(POLICY_RUN, on_p, expected_follow_ups),
                *_answered(STOCK_RUN, stock_p, expected_follow_ups)]
    ahead = _median(stock_p.served_ahead)
    if ahead is None or ahead < 1:
        problems.append(
            f"{STOCK_RUN}: premium follow-ups did not wait behind the burst: a median of "
            f"{'-' if ahead is None else f'{ahead:.0f}'} free requests queued before one "
            "were served while it waited")

    machine = max((s.client_lag or 0.0 for s in (on_p, stock_p)), default=0.0)
    on_p99, stock_p99 = on_p.percentile(99), stock_p.percentile(99)
    if (on_p99 is not None and stock_p99 is not None
            and abs(stock_p99 - on_p99) <= STALLS_PER_TURN * machine):
        problems.append(
            f"the machine was too busy: the load generator itself woke up to "
            f"{_ms(machine)} late while premium turns were in flight; twice that is as "
            f"much as the difference between the runs' premium follow-up TTFT p99 "
            f"({_ms(on_p99)} with KVQuota, {_ms(stock_p99)} on stock): one such stall in "
            f"the load generator and one in the sidecar could make it")

    findings = [_cache_finding(on_p, stock_p), _queue_finding(on_p, stock_p),
                _refusal_finding(on, stock),
                f"machine: while premium turns were in flight the load generator woke up at "
                f"worst {_ms(on_p.client_lag)} late in the KVQuota run, "
                f"{_ms(stock_p.client_lag)} in the stock run"]
    shown = not problems and on_p99 is not None and stock_p99 is not None
    ratio = on_p99 / stock_p99 if shown and on_p99 is not None and stock_p99 else None
    return Verdict(shown=shown, protected=ratio is not None and ratio < 1.0, ratio=ratio,
                   findings=findings, problems=problems)


def _hit(s: TierSummary) -> str:
    return "-" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.0%}"


def _cache_finding(on: TierSummary, stock: TierSummary) -> str:
    return (f"prefix cache (KV leases): premium follow-ups found {_hit(on)} of their prompt "
            f"tokens cached with KVQuota, {_hit(stock)} on stock vLLM (evicted by the burst)")


def _median(values: list[int]) -> float | None:
    return percentile([float(v) for v in values], 50)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _queue_finding(on: TierSummary, stock: TierSummary) -> str:
    queue = (f", sidecar queue p50 {percentile(on.queue_ms, 50):.0f} ms"
             if on.queue_ms else "")
    return (f"queue position (priority + admission): on stock vLLM a follow-up found a median "
            f"of {_count(_median(stock.engine_waiting))} free requests waiting for KV and was "
            f"served after {_count(_median(stock.served_ahead))} of them (TTFT p50 "
            f"{_ms(stock.percentile(50))}); with KVQuota the free tier was held at its "
            f"ceiling and a follow-up was served after {_count(_median(on.served_ahead))} "
            f"(TTFT p50 {_ms(on.percentile(50))}{queue})")


def _refusal_finding(on: dict[str, TierSummary], stock: dict[str, TierSummary]) -> str:
    def get(tiers: dict[str, TierSummary], kind: str) -> TierSummary:
        return tiers.get(kind, TierSummary(kind))

    def refused(s: TierSummary) -> str:
        queued = f", {s.queued} admitted after queueing in the sidecar" if s.queued else ""
        return f"{s.rejected_quota} x 429 + {s.rejected_watermark} x 503{queued}"

    premium = sum(get(on, k).rejected_quota + get(on, k).rejected_watermark
                  for k in (PREMIUM_FIRST, PREMIUM))
    free, stock_free = get(on, FREE), get(stock, FREE)
    return (f"refusals by tier with KVQuota: premium {premium}, free {refused(free)} "
            f"(retried after Retry-After; {free.admitted} free requests served); stock vLLM "
            f"refused {stock_free.rejected_quota + stock_free.rejected_watermark} and served "
            f"{stock_free.admitted}")
