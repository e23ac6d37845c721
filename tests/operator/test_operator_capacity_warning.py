"""maxBlocks above the pool's capacity: accepted, but a Warning event says so."""

from __future__ import annotations

from datetime import UTC, datetime

from operator_objects import pool, quota

from kvquota.policy.plan import plan_pool
from kvquota.reconcile.status import event_worthy, tenant_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _status(maximum: int, old: dict | None = None) -> dict:
    plan = plan_pool(pool(capacity=1000), [quota("q", guaranteed=100, maximum=maximum)],
                     namespace="default", name="demo-pool", ready_replicas=1)
    tenant = plan.tenants[("default", "q")]  # type: ignore[index]
    return tenant_status(tenant, plan, engines=None, old=old, generation=1, now=NOW)


def test_max_blocks_above_capacity_posts_a_warning_event_once() -> None:
    fits = _status(1000)
    too_big = _status(5000, old=fits)
    events = event_worthy("TenantQuota", fits, too_big)
    assert [(kind, reason) for kind, reason, _ in events] == [
        ("Warning", "MaxBlocksAboveCapacity")]
    assert "maxBlocks 5000 is above the pool's capacity of 1000 blocks" in events[0][2]
    assert event_worthy("TenantQuota", too_big, _status(5000, old=too_big)) == []
    assert event_worthy("TenantQuota", too_big, _status(1000, old=too_big)) == []
