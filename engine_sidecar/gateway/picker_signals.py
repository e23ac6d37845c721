"""What the engine really has in front of it, per tier, for an endpoint picker.

The Gateway API Inference Extension's endpoint picker (EPP) and llm-d's scheduler score
pods from the model server's own metrics, by default `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`. A request held in the sidecar's admission queue is in
neither, and a reservation the engine has not allocated yet is not in vLLM's KV usage:
a picker reading vLLM alone sees an engine with a deep admission queue as idle and
keeps sending it work. These series count both, and are served beside vLLM's own on
the scrape of the client port (`metrics_scrape`), the port the picker already reads.

Per tier, because a picker routing premium should see what premium waits behind, not
the free tier's backlog that premium overtakes (the admission queue and vLLM's
priority queue both serve lower `priority` first, and the plugin's victim order takes
blocks from lower tiers first):

- `kvquota:num_requests_waiting{tier=T}`: requests of tier T and of every tier ahead
  of it (lower or equal priority) waiting in the engine (the plugin's stats) plus those
  queued in the sidecar.
- `kvquota:kv_cache_usage_perc{tier=T}`: the KV blocks those tiers' tenants hold
  (running and leased) plus what they reserved and the engine has not allocated yet,
  over the engine's capacity (0..1). Blocks of lower tiers and of unclassified traffic
  are left out: the victim order gives them back before a request of tier T.
- `tier="all"`: every request and every block, whichever tier (and unclassified
  traffic): what a single picker for all tiers should read.

Four label values at most (the three tiers and "all"): never a tenant or a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_sidecar.contract.policy import EnginePolicy, Tier
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.active_policy import ActivePolicy
from engine_sidecar.gateway.admission import PoolView
from engine_sidecar.gateway.admission_queue import AdmissionQueue

WAITING = "kvquota:num_requests_waiting"
KV_USAGE = "kvquota:kv_cache_usage_perc"
TIER_LABEL = "tier"
ALL_TIERS = "all"
# A tier no tenant of the policy is in takes its default priority (spec.tiers).
DEFAULT_PRIORITY = {Tier.PREMIUM: 0, Tier.STANDARD: 1, Tier.FREE: 2}

WAITING_HELP = (
    "Requests waiting in front of this engine: in the engine's own queue (the scheduler "
    "plugin's stats) plus in the KVQuota sidecar's admission queue. tier=T counts the "
    "requests of tier T and of every tier served before it (lower or equal priority), "
    "what a request of tier T waits behind; tier=all counts every request."
)
KV_USAGE_HELP = (
    "KV cache in use from the viewpoint of a new request, 0..1: blocks held (running "
    "and leased) plus blocks reserved at admission and not allocated yet, over the "
    "engine's capacity. tier=T counts the tenants of tier T and of every tier served "
    "before it (the blocks a request of tier T cannot take back); tier=all counts "
    "every block. Absent while the capacity is unknown."
)


@dataclass(frozen=True)
class TierSignal:
    """One tier's values (`tier` is a Tier's value or ALL_TIERS)."""

    tier: str
    waiting: int
    kv_usage: float | None  # None: the engine's capacity is unknown


def tier_priorities(policy: EnginePolicy | None) -> dict[Tier, int]:
    """Each tier's vLLM priority: its tenants' (the lowest, should they differ)."""
    priorities = dict(DEFAULT_PRIORITY)
    seen: dict[Tier, int] = {}
    for tenant in (policy.tenants.values() if policy else ()):
        seen[tenant.tier] = min(seen.get(tenant.tier, tenant.priority), tenant.priority)
    priorities.update(seen)
    return priorities


def tier_signals(
    policy: EnginePolicy | None, stats: EngineStats | None, queue: AdmissionQueue,
    view: PoolView | None,
) -> list[TierSignal]:
    """The series' values: one per tier, then "all"."""
    tenants = policy.tenants if policy else {}
    engine_waiting = {t: s.waiting for t, s in stats.tenants.items()} if stats else {}
    total = view.total_blocks if view is not None and view.known else None
    held_by = ({t: view.holding(t).used for t in (view.tenants or {})}
               if view is not None and total else {})
    signals = []
    for tier, priority in tier_priorities(policy).items():
        ahead = [t for t, tenant in tenants.items() if tenant.priority <= priority]
        waiting = sum(engine_waiting.get(t, 0) + queue.depth(t) for t in ahead)
        usage = None
        if total:
            usage = _fraction(sum(held_by.get(t, 0) for t in ahead), total)
        signals.append(TierSignal(tier.value, waiting, usage))
    waiting_all = sum(engine_waiting.values()) + queue.waiting()
    usage_all = None
    if view is not None and total:
        usage_all = _fraction(total - view.free_blocks, total)
    signals.append(TierSignal(ALL_TIERS, waiting_all, usage_all))
    return signals


def _fraction(blocks: int, total: int) -> float:
    """Capped at 1: pickers read the series as vLLM's, a fraction of the cache."""
    return round(min(1.0, max(0.0, blocks / total)), 6)


@dataclass
class SignalSources:
    """What the collector reads at scrape time (callables: always the latest)."""

    active: Callable[[], ActivePolicy | None]
    stats: Callable[[], EngineStats | None]
    view: Callable[[], PoolView | None]
    queue: AdmissionQueue


class PickerSignals(Collector):
    """The series above, rendered for the client port's /metrics (own registry: they
    are not the admin port's `kvquota_*` families)."""

    def __init__(self, sources: SignalSources) -> None:
        self._s = sources
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        active = self._s.active()
        signals = tier_signals(active.policy if active else None, self._s.stats(),
                               self._s.queue, self._s.view())
        waiting = GaugeMetricFamily(WAITING, WAITING_HELP, labels=[TIER_LABEL])
        usage = GaugeMetricFamily(KV_USAGE, KV_USAGE_HELP, labels=[TIER_LABEL])
        for signal in signals:
            waiting.add_metric([signal.tier], signal.waiting)
            if signal.kv_usage is not None:
                usage.add_metric([signal.tier], signal.kv_usage)
        yield waiting
        if usage.samples:
            yield usage

    def exposition(self) -> bytes:
        """The series in Prometheus' text format (0.0.4), as vLLM's /metrics is."""
        return generate_latest(self.registry)
