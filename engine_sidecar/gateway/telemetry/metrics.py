"""Prometheus metrics: one registry per app; tenant labels capped.

Metric names are a contract with the dashboards and alerts (DESIGN.md section 6).
Gauges and counters that mirror state (the ledger, the plugin's stats file, the active
policy) are produced by a Collector at scrape time, so they are never stale and
tenants that left the policy disappear.

Cardinality: a `tenant_id` label is only ever a tenant of the active policy (first
`tenant_label_limit` of them seen), else "other"; failed authentication uses
"unknown". A tenant that leaves the policy gives its label back (its admission series
are dropped), so tenants added later get labels of their own. Latency histograms are
labelled by tier only.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.output_estimate import ALL_ROUTES
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.policy.active import ActivePolicy
from engine_sidecar.gateway.pool.admission import PoolAdmission

OTHER = "other"
UNKNOWN = "unknown"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class TenantLabels:
    """First come, first labelled, up to `limit` tenants of the active policy."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, tenant_id: str | None, policy_tenants: Container[str]) -> str:
        if not tenant_id:
            return UNKNOWN
        if tenant_id in self._known:
            return tenant_id
        if tenant_id in policy_tenants and len(self._known) < self.limit:
            self._known.add(tenant_id)
            return tenant_id
        return OTHER

    def retain(self, policy_tenants: Container[str]) -> set[str]:
        """Free the labels of tenants no longer in the policy; the tenants freed."""
        gone = {t for t in self._known if t not in policy_tenants}
        self._known -= gone
        return gone


@dataclass
class StateSources:
    """What the scrape-time collector reads; callables so it always sees the latest."""

    ledger: Ledger
    active: Callable[[], ActivePolicy | None]
    stats: Callable[[], EngineStats | None]
    label: Callable[[str], str]
    queue: AdmissionQueue | None = None


class StateCollector(Collector):
    def __init__(self, sources: StateSources) -> None:
        self._s = sources

    def collect(self) -> Iterator[Metric]:
        active = self._s.active()
        stats = self._s.stats()
        label = self._s.label
        tenants = active.policy.tenants if active else {}

        reserved = GaugeMetricFamily("kvquota_tenant_blocks_reserved",
                                     "KV blocks charged for in-flight requests: what they "
                                     "take now plus one bound on their joint growth.",
                                     labels=["tenant_id"])
        inflight = GaugeMetricFamily("kvquota_tenant_inflight_requests",
                                     "Requests admitted and not finished.", labels=["tenant_id"])
        sums: dict[str, list[int]] = {}
        for tenant_id in {*tenants, *self._s.ledger.tenants()}:
            row = sums.setdefault(label(tenant_id), [0, 0])
            row[0] += self._s.ledger.reserved_blocks(tenant_id)
            row[1] += self._s.ledger.inflight(tenant_id)
        for name, (blocks, count) in sorted(sums.items()):
            reserved.add_metric([name], blocks)
            inflight.add_metric([name], count)
        yield reserved
        yield inflight
        queue = self._s.queue
        if queue is not None:
            yield from self._queue_families(queue, tenants, label)
            if active is not None and queue.policy is not None:
                yield from self._reservation_families(queue, active, label)
            if queue.pool is not None:
                yield from self._pool_families(queue.pool)

        if active is not None:
            info = GaugeMetricFamily("kvquota_policy_info", "The active policy version (1).",
                                     labels=["version", "pool"])
            info.add_metric([active.version, active.policy.pool], 1)
            yield info
        if stats is None:
            return
        yield GaugeMetricFamily("kvquota_engine_total_blocks", "Engine KV cache blocks.",
                                value=stats.total_blocks)
        yield GaugeMetricFamily("kvquota_engine_free_blocks", "Free engine KV cache blocks.",
                                value=stats.free_blocks)
        modes = CounterMetricFamily(
            "kvquota_engine_preemptions",
            "Preempted requests by how their KV came back: recompute, or offload "
            "(reloaded from the KV offload tier).", labels=["mode"])
        for mode, count in sorted(stats.preemptions_by_mode.items()):
            modes.add_metric([mode[:32]], count)
        yield modes
        yield from self._plugin_families(stats, tenants, label)

    @staticmethod
    def _pool_families(pool: PoolAdmission) -> Iterator[Metric]:
        """What the pool-wide ledger decided (only for pools with a store)."""
        charges = CounterMetricFamily(
            "kvquota_pool_store_charges",
            "Admissions checked against the pool-wide ledger, by outcome: local (within "
            "this sidecar's allowance, no round trip), pool (granted by the store), "
            "refused (the pool-wide total did not allow it), fallback (store down: "
            "beyond what this sidecar had claimed).", labels=["outcome"])
        for outcome, count in sorted(pool.charges.items()):
            charges.add_metric([outcome.value], count)
        yield charges
        yield CounterMetricFamily(
            "kvquota_pool_store_guarantee_admissions",
            "Borrowers admitted into this engine's watermark room because the store found "
            "their tenant within its pool-wide guarantee.", value=pool.within_guarantee)

    @staticmethod
    def _queue_families(
        queue: AdmissionQueue, tenants: object, label: Callable[[str], str]
    ) -> Iterator[Metric]:
        depth = GaugeMetricFamily("kvquota_tenant_queued_requests",
                                  "Requests waiting in the sidecar's admission queue.",
                                  labels=["tenant_id"])
        oldest = GaugeMetricFamily("kvquota_tenant_queue_oldest_wait_seconds",
                                   "How long the tenant's oldest queued request has waited.",
                                   labels=["tenant_id"])
        rows: dict[str, list[float]] = {}
        for tenant_id in {*(tenants if isinstance(tenants, dict) else ()), *queue.tenants()}:
            row = rows.setdefault(label(tenant_id), [0, 0.0])
            row[0] += queue.depth(tenant_id)
            row[1] = max(row[1], queue.oldest_wait(tenant_id))
        for name, (count, wait) in sorted(rows.items()):
            depth.add_metric([name], count)
            oldest.add_metric([name], wait)
        yield depth
        yield oldest

    @staticmethod
    def _reservation_families(
        queue: AdmissionQueue, active: ActivePolicy, label: Callable[[str], str]
    ) -> Iterator[Metric]:
        """Reserved vs held, and the output estimates reservations count."""
        charged = GaugeMetricFamily(
            "kvquota_tenant_blocks_charged",
            "KV blocks counted against the tenant's maxBlocks: what its running requests "
            "hold plus the bound on their joint growth and prompts not scheduled yet.",
            labels=["tenant_id"])
        pending = GaugeMetricFamily(
            "kvquota_tenant_blocks_pending",
            "KV blocks charged for the tenant's work not allocated yet.", labels=["tenant_id"])
        above = GaugeMetricFamily(
            "kvquota_tenant_blocks_above_max",
            "KV blocks charged to the tenant beyond its maxBlocks: work run in KV no other "
            "tenant wanted (aboveMax: Reclaimable).", labels=["tenant_id"])
        beside_idle = CounterMetricFamily(
            "kvquota_tenant_queue_beside_idle_kv_seconds",
            "Seconds the tenant's queued requests waited on its maxBlocks while the blocks "
            "they asked for were free above the watermark and nobody else waited for them.",
            labels=["tenant_id"])
        estimate = GaugeMetricFamily(
            "kvquota_tenant_output_estimate_tokens",
            "Output tokens a request of the tenant reserves now, by route (all: over every "
            "route); maxTokens for a tier that reserves Full.", labels=["tenant_id", "route"])
        view = queue.view()
        policy = active.policy
        rows: dict[str, list[int]] = {}
        for tenant_id in {*(view.tenants or {}), *queue.ledger.tenants()}:
            seen = view.tenant(tenant_id)
            tenant = policy.tenants.get(tenant_id)
            row = rows.setdefault(label(tenant_id), [0, 0, 0])
            row[0] += seen.charged
            row[1] += seen.growth
            row[2] += max(0, seen.charged - tenant.max_blocks_per_engine) if tenant else 0
        for name, (blocks, growth, beyond) in sorted(rows.items()):
            charged.add_metric([name], blocks)
            pending.add_metric([name], growth)
            above.add_metric([name], beyond)
        waits: dict[str, float] = {}
        for tenant_id, waited in queue.idle_waits.items():
            waits[label(tenant_id)] = waits.get(label(tenant_id), 0.0) + waited
        for name, total in sorted(waits.items()):
            beside_idle.add_metric([name], total)
        estimates: dict[tuple[str, str], int] = {}
        for tenant_id, tenant in policy.tenants.items():
            name = label(tenant_id)
            if name in (OTHER, UNKNOWN):
                continue  # an estimate summed over tenants says nothing
            for route in ("all", *queue.estimates.routes(tenant_id)):
                key = ALL_ROUTES if route == "all" else route
                estimates[(name, route)] = queue.estimates.in_use(tenant, policy, key)
        for (name, route), tokens in sorted(estimates.items()):
            estimate.add_metric([name, route], tokens)
        yield from (charged, pending, above, beside_idle, estimate)

    def _plugin_families(
        self, stats: EngineStats, tenants: object, label: Callable[[str], str]
    ) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvquota_tenant_blocks_used",
                                 "KV blocks the tenant holds in the engine (running + leased).",
                                 labels=["tenant_id"])
        leased = GaugeMetricFamily("kvquota_tenant_blocks_leased",
                                   "KV blocks pinned by the tenant's session leases.",
                                   labels=["tenant_id"])
        sessions = GaugeMetricFamily("kvquota_tenant_leased_sessions",
                                     "Idle sessions whose KV is pinned by a lease.",
                                     labels=["tenant_id"])
        swapped = GaugeMetricFamily("vllm_tenant_active_swapped_blocks",
                                    "KV blocks of the tenant's preempted requests held "
                                    "offloaded.", labels=["tenant_id"])
        breaks = CounterMetricFamily("kvquota_lease_breaks", "Leases released early.",
                                     labels=["tenant_id"])
        degraded = CounterMetricFamily("kvquota_degraded_events",
                                       "Degraded-mode releases of premium leases.",
                                       labels=["tenant_id"])
        outgrown = CounterMetricFamily(
            "kvquota_tenant_outgrown_preemptions",
            "Preemptions of the tenant's requests that held more KV blocks than the sidecar "
            "reserved for them (they decoded past their output estimate).",
            labels=["tenant_id"])
        evictions = CounterMetricFamily(
            "vllm_tenant_kv_cache_evictions",
            "Preemptions of the tenant's requests by reason.",
            labels=["tenant_id", "priority", "preemption_reason"],
        )
        policy_tenants = tenants if isinstance(tenants, dict) else {}
        rows: dict[str, list[int]] = {}
        reasons: dict[tuple[str, str, str], int] = {}
        for tenant_id, t in stats.tenants.items():
            name = label(tenant_id)
            row = rows.setdefault(name, [0, 0, 0, 0, 0, 0, 0])
            for i, value in enumerate((t.used_blocks, t.leased_blocks, t.leased_sessions,
                                       t.swapped_blocks, t.lease_breaks, t.degraded_events,
                                       t.outgrown_preemptions)):
                row[i] += value
            tenant = policy_tenants.get(tenant_id)
            priority = str(tenant.priority) if tenant is not None else ""
            for reason, count in t.preemptions.items():
                key = (name, priority, reason[:64])
                reasons[key] = reasons.get(key, 0) + count
        for name, row in sorted(rows.items()):
            used.add_metric([name], row[0])
            leased.add_metric([name], row[1])
            sessions.add_metric([name], row[2])
            swapped.add_metric([name], row[3])
            breaks.add_metric([name], row[4])
            degraded.add_metric([name], row[5])
            outgrown.add_metric([name], row[6])
        for key, count in sorted(reasons.items()):
            evictions.add_metric(list(key), count)
        yield from (used, leased, sessions, swapped, breaks, degraded, outgrown, evictions)


class TierSeries(NamedTuple):
    """A tier's series on the request path (children looked up once per tier)."""

    ttft: Any
    duration: Any
    reserved_blocks: Any
    ceiling_admissions: Any


class GatewayMetrics:
    def __init__(self, tenant_label_limit: int = 100) -> None:
        self._tiers: dict[str, TierSeries] = {}
        self.registry = CollectorRegistry()
        self.labels = TenantLabels(tenant_label_limit)
        r = self.registry
        self.admissions = Counter(
            "kvquota_admissions", "Admission decisions.",
            ["tenant_id", "tier", "decision"], registry=r)
        self.rejections = Counter(
            "kvquota_rejections", "Requests refused by the sidecar, by reason.",
            ["reason"], registry=r)
        self.reservations = Counter(
            "kvquota_reservations", "Block reservations released, by outcome "
            "(completed, upstream_error, timeout, cancelled).", ["tier", "outcome"], registry=r)
        self.reserved_blocks = Counter(
            "kvquota_reserved_blocks", "KV blocks reserved at admission.", ["tier"], registry=r)
        self.ceiling_admissions = Counter(
            "kvquota_ceiling_admissions", "Requests admitted on their prompts' token "
            "ceiling (a bound from their size) and counted exactly once forwarded; the other "
            "admitted requests were counted before admission.", ["tier"], registry=r)
        self.queue_wait = Histogram(
            "kvquota_queue_wait_seconds",
            "Time requests waited in the admission queue, by how they left it "
            "(admitted, refused).", ["tier", "result"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "kvquota_upstream_ttft_seconds",
            "Time from forwarding to the engine's first response byte.",
            ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram(
            "kvquota_upstream_duration_seconds",
            "Time from forwarding to the end of the engine's response.",
            ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "kvquota_upstream_errors", "Failed calls to the engine, by kind.",
            ["kind"], registry=r)
        self.policy_errors = Counter(
            "kvquota_policy_errors", "Policies refused (the last good one stays active).",
            registry=r)

    def tier(self, tier: str) -> TierSeries:
        series = self._tiers.get(tier)
        if series is None:
            series = self._tiers[tier] = TierSeries(
                self.ttft.labels(tier), self.duration.labels(tier),
                self.reserved_blocks.labels(tier), self.ceiling_admissions.labels(tier))
        return series

    def attach_state(self, sources: StateSources) -> None:
        self.registry.register(StateCollector(sources))

    def retain_tenants(self, policy_tenants: Container[str]) -> None:
        """A new policy is active: tenants it dropped stop being reported and free their
        label slots. (Scrape-time families follow the policy by themselves.)"""
        for tenant_id in self.labels.retain(policy_tenants):
            series = {
                (sample.labels["tier"], sample.labels["decision"])
                for family in self.admissions.collect() for sample in family.samples
                if sample.labels.get("tenant_id") == tenant_id
            }
            for tier, decision in series:
                self.admissions.remove(tenant_id, tier, decision)
