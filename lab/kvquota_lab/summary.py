"""Per-kind summaries of a run's results: premium first turns, premium follow-ups, free."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvquota_lab.loadgen import Result
from kvquota_lab.percentile import percentile


@dataclass
class TierSummary:
    """One kind of request in one run: premium first turns, premium follow-ups, free."""

    tier: str
    ttfts: list[float] = field(default_factory=list)
    admitted: int = 0
    rejected_quota: int = 0  # 429 (block quota or concurrency)
    rejected_watermark: int = 0  # 503
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_ms: list[float] = field(default_factory=list)  # x-kvquota-queue-ms, admitted
    sent: int = 0  # premium follow-ups sent
    held: int = 0  # ... of which while the burst held the cache
    engine_waiting: list[int] = field(default_factory=list)
    # premium follow-ups: free requests sent before it that got their first token while
    # it waited for its own (FCFS serves what queued first)
    served_ahead: list[int] = field(default_factory=list)
    client_lag: float | None = None  # the client's worst wake-up delay during follow-ups

    def percentile(self, q: float) -> float | None:
        return percentile(self.ttfts, q)

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def mean_prompt_tokens(self) -> float | None:
        return self.prompt_tokens / self.admitted if self.admitted else None

    @property
    def queued(self) -> int:
        """Admitted after waiting in the sidecar's queue (x-kvquota-queue-ms > 0)."""
        return sum(1 for ms in self.queue_ms if ms > 0)


PREMIUM_FIRST, PREMIUM, FREE = "premium_first", "premium", "free"


def _kind(r: Result) -> str:
    if r.tier == "premium":
        return PREMIUM_FIRST if r.round == 0 else PREMIUM
    return r.tier


def _first_token_at(r: Result) -> float | None:
    return r.sent_at + r.ttft if r.status == 200 and r.ttft is not None else None


def served_ahead(turn: Result, results: list[Result]) -> int | None:
    """Free requests queued before `turn` was sent that got a first token before it."""
    first = _first_token_at(turn)
    if first is None:
        return None
    return sum(
        1 for r in results
        if r.tier == FREE and r.sent_at < turn.sent_at
        and (at := _first_token_at(r)) is not None and turn.sent_at < at < first
    )


def summarise(results: list[Result]) -> dict[str, TierSummary]:
    kinds: dict[str, TierSummary] = {}
    for r in results:
        s = kinds.setdefault(_kind(r), TierSummary(_kind(r)))
        if r.tier == "premium" and r.round > 0:
            s.sent += 1
            s.held += r.held is not None
            if r.engine_waiting is not None:
                s.engine_waiting.append(r.engine_waiting)
            if (ahead := served_ahead(r, results)) is not None:
                s.served_ahead.append(ahead)
            if r.client_lag is not None:
                s.client_lag = max(s.client_lag or 0.0, r.client_lag)
        if r.status == 200:
            s.admitted += 1
            if r.ttft is not None:
                s.ttfts.append(r.ttft)
            s.prompt_tokens += r.prompt_tokens
            s.cached_tokens += r.cached_tokens
            if r.queue_ms is not None:
                s.queue_ms.append(r.queue_ms)
        elif r.status == 429:
            s.rejected_quota += 1
        elif r.status == 503 and r.code == "KV_CACHE_WATERMARK_EXCEEDED":
            s.rejected_watermark += 1
        else:
            s.failed += 1
    return kinds
