"""The status document the operator polls (`SidecarStatus` at `/kvquota/status`).

Merges three views: the admission ledger (reservations, in-flight), the sidecar's
decision counters, and the plugin's engine stats (blocks used and leased, preemptions,
lease breaks, degraded events). Counters are per process: they restart from zero with
the sidecar, like any Prometheus counter. Messages name files, never where they live on
the server (`hide_paths`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from engine_sidecar.contract.stats import (
    EngineStats,
    SidecarStatus,
    TenantCounters,
    TenantStatus,
    TenantUsage,
)
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.admission.rules import Decision, PoolView
from engine_sidecar.gateway.policy.active import ActivePolicy

# An absolute path: a "/" that starts a word (not inside a URL or a "ns/name").
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"(),;:]+/)*([^\s/'\"(),;:]+)")


def hide_paths(message: str) -> str:
    """Every absolute path in `message` cut to its last component: status readers (the
    operator, CR status) learn which file, not the pod's file system layout."""
    return _ABSOLUTE_PATH.sub(r"\1", message)


@dataclass
class _Counts:
    admitted: int = 0
    rejected_quota: int = 0
    rejected_watermark: int = 0


@dataclass
class DecisionCounters:
    """Per-tenant decision counts for the CR status (concurrency counts as quota)."""

    by_tenant: dict[str, _Counts] = field(default_factory=lambda: defaultdict(_Counts))

    def count(self, tenant_id: str, decision: Decision) -> None:
        counts = self.by_tenant[tenant_id]
        if decision is Decision.ADMITTED:
            counts.admitted += 1
        elif decision in (Decision.REJECTED_QUOTA, Decision.REJECTED_CONCURRENCY):
            counts.rejected_quota += 1
        elif decision is Decision.REJECTED_WATERMARK:
            counts.rejected_watermark += 1


def build_status(
    *,
    ready: bool,
    active: ActivePolicy | None,
    policy_error: str | None,
    ledger: Ledger,
    counters: DecisionCounters,
    stats: EngineStats | None,
    capacity: PoolView | None,
    queue: AdmissionQueue,
    stats_age: float | None = None,
    stats_stale: bool = False,
    pool_store_problem: str | None = None,
) -> SidecarStatus:
    """`stats` are the plugin's stats admission uses (None when missing or stale);
    `stats_age` is how old the latest ones are, stale or not; `pool_store_problem`: why
    the store the policy names is not used (`PoolLink.problem`)."""
    errors = [policy_error] if policy_error else []
    if stats is not None and stats.policy_error:
        errors.append(f"scheduler plugin: {stats.policy_error}")
    tenants: dict[str, TenantStatus] = {}
    tenant_ids = set(active.policy.tenants) if active else set()
    tenant_ids.update(ledger.tenants())
    tenant_ids.update(queue.tenants())
    policy = active.policy if active else None
    for tenant_id in sorted(tenant_ids):
        engine = stats.tenants.get(tenant_id) if stats else None
        reserved = ledger.reserved_blocks(tenant_id)
        counts = counters.by_tenant.get(tenant_id, _Counts())
        view = capacity.tenant(tenant_id) if capacity else None
        tenant = policy.tenants.get(tenant_id) if policy else None
        usage = TenantUsage(
            blocks=engine.used_blocks if engine else reserved,
            reserved_blocks=reserved,
            pending_blocks=view.growth if view else reserved,
            charged_blocks=view.charged if view else reserved,
            above_max_blocks=max(0, view.charged - tenant.max_blocks_per_engine)
            if view and tenant else 0,
            output_estimate_tokens=queue.estimates.in_use(tenant, policy)
            if tenant is not None and policy is not None else 0,
            leased_blocks=engine.leased_blocks if engine else 0,
            leased_sessions=engine.leased_sessions if engine else 0,
            inflight=ledger.inflight(tenant_id),
            queued=queue.depth(tenant_id),
            queue_wait_seconds=round(queue.oldest_wait(tenant_id), 3),
        )
        status_counters = TenantCounters(
            admitted=counts.admitted,
            rejected_quota=counts.rejected_quota,
            rejected_watermark=counts.rejected_watermark,
            preemptions=sum(engine.preemptions.values()) if engine else 0,
            outgrown_preemptions=engine.outgrown_preemptions if engine else 0,
            lease_breaks=engine.lease_breaks if engine else 0,
            degraded_events=engine.degraded_events if engine else 0,
        )
        tenants[tenant_id] = TenantStatus(usage=usage, counters=status_counters)
    return SidecarStatus(
        ready=ready,
        policy_version=active.version if active else None,
        policy_error=hide_paths("; ".join(errors)) or None,
        total_blocks=(capacity.total_blocks if capacity else None) or 0,
        free_blocks=capacity.free_blocks if capacity and capacity.known else 0,
        degraded=bool(stats and stats.degraded),
        pool_store_reachable=(False if pool_store_problem is not None else
                              queue.pool.store.reachable if queue.pool is not None else None),
        pool_store_problem=pool_store_problem,
        tenants=tenants,
        capacity_source=capacity.source if capacity else None,
        engine_stats_age_seconds=round(stats_age, 3) if stats_age is not None else None,
        engine_stats_stale=stats_stale,
    )
