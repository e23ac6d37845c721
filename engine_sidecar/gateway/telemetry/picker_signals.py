"""What the engine really has in front of it, per tier, for an endpoint picker.

Pickers (the Gateway API Inference Extension's EPP, llm-d's scheduler) score pods from
vLLM's `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, which miss the
sidecar's admission queue and the reservations the engine has not allocated yet.
These series count both, per tier and for `tier="all"`, and are served on the client
port's scrape beside vLLM's (`metrics_scrape`):
- `kvquota:num_requests_waiting{tier=T}`: requests of T and of the tiers served before
  it, waiting in the engine or queued in the sidecar;
- `kvquota:kv_cache_usage_perc{tier=T}`: 1 - the blocks a request of T can still get
  here over those it could get on an empty engine, under the cache above the watermark
  or T's per-engine maxBlocks, whichever leaves fewer (compared in blocks, never as
  fractions of different wholes).
Four label values at most. Why each term is there: docs/gateway.md (telemetry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy, Tier
from engine_sidecar.contract.reclaim import watermark_floor
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.admission.rules import PoolView
from engine_sidecar.gateway.policy.active import ActivePolicy

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
    "KV cache in use from the viewpoint of a new request, 0..1. tier=T: 1 - the blocks "
    "a request of tier T can still get on this engine over those it could get on an "
    "empty one, in blocks the smaller of (the capacity above the watermark less the "
    "blocks held, running and leased, plus reserved and not allocated yet, by the tiers "
    "served before T and less T's charge, or what is left of T's guarantee if more) and "
    "(the sum of T's tenants' maxBlocks on this engine less their charge): how close a "
    "request of tier T is to not fitting. tier=all: every block over capacity. Absent "
    "while the capacity is unknown."
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
    signals = []
    for tier, priority in tier_priorities(policy).items():
        ahead = [t for t, tenant in tenants.items() if tenant.priority <= priority]
        waiting = sum(engine_waiting.get(t, 0) + queue.depth(t) for t in ahead)
        usage = None
        if view is not None and total:
            usage = _tier_usage(view, tenants, tier, priority, total)
        signals.append(TierSignal(tier.value, waiting, usage))
    waiting_all = sum(engine_waiting.values()) + queue.waiting()
    usage_all = None
    if view is not None and total:
        usage_all = _fraction(total - view.free_blocks, total)
    signals.append(TierSignal(ALL_TIERS, waiting_all, usage_all))
    return signals


def _tier_usage(view: PoolView, tenants: Mapping[str, TenantPolicy], tier: Tier,
                priority: int, total: int) -> float:
    """1 - (blocks a request of `tier` can still get here) / (what it could get on an
    empty engine): the smaller of its room under the capacity and under its ceiling."""
    floor = watermark_floor(view.policy.watermark, total) if view.policy else 0
    room = whole = total - floor  # a borrower's: the watermark keeps the rest
    room -= _capacity_blocks(view, tenants, priority)
    members = _tier_tenants(view, tier)
    if members:
        charged = sum(view.tenant(t.tenant_id).charged for t in members)
        guaranteed = sum(t.guaranteed_blocks for t in members)
        ceiling = sum(t.max_blocks_per_engine for t in members)
        room = min(max(room, guaranteed - charged), ceiling - charged)
        whole = min(max(whole, guaranteed), ceiling)
    return _fraction(whole - room, whole)


def _capacity_blocks(view: PoolView, tenants: Mapping[str, TenantPolicy],
                     priority: int) -> int:
    """Blocks a request of `priority` cannot take back: the tiers ahead of it hold and
    will allocate, its own tier is charged (`_TenantView.charged`)."""
    blocks = 0
    for tenant_id in view.tenants or {}:
        tenant = tenants.get(tenant_id)
        if tenant is None or tenant.priority > priority:
            continue
        if tenant.priority < priority:
            blocks += view.holding(tenant_id).used
        else:
            blocks += view.tenant(tenant_id).charged
    return blocks


def _tier_tenants(view: PoolView, tier: Tier) -> list[TenantPolicy]:
    return [t for t in (view.policy.tenants.values() if view.policy else ()) if t.tier is tier]


def _fraction(blocks: int, total: int) -> float:
    """Within 0..1: pickers read the series as vLLM's (1 for a zero `total`)."""
    if total <= 0:
        return 1.0
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
