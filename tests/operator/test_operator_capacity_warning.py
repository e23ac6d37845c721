"""maxBlocks above the pool's capacity, or above what an engine can ever give the tenant:
accepted, but a Warning event says so."""

from __future__ import annotations

from datetime import UTC, datetime

from operator_objects import pool, quota

from kvquota.policy.plan import plan_pool
from kvquota.reconcile.status import event_worthy, tenant_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _status(maximum: int, old: dict | None = None, *, guaranteed: int = 100,
            capacity: int = 1000, replicas: int = 1) -> dict:
    plan = plan_pool(pool(capacity=capacity),
                     [quota("q", guaranteed=guaranteed, maximum=maximum)],
                     namespace="default", name="demo-pool", ready_replicas=replicas)
    tenant = plan.tenants[("default", "q")]  # type: ignore[index]
    return tenant_status(tenant, plan, engines=None, old=old, generation=1, now=NOW)


def test_max_blocks_above_capacity_posts_a_warning_event_once() -> None:
    fits = _status(850)  # 1000 blocks, 150 kept by the watermark
    too_big = _status(5000, old=fits)
    events = event_worthy("TenantQuota", fits, too_big)
    assert [(kind, reason) for kind, reason, _ in events] == [
        ("Warning", "MaxBlocksAboveCapacity")]
    assert "maxBlocks 5000 is above the pool's capacity of 1000 blocks" in events[0][2]
    assert event_worthy("TenantQuota", too_big, _status(5000, old=too_big)) == []
    assert event_worthy("TenantQuota", too_big, _status(850, old=too_big)) == []


def _accepted(status: dict) -> dict:
    (accepted,) = [c for c in status["conditions"] if c["type"] == "Accepted"]
    return accepted


def test_a_max_no_engine_can_give_the_tenant_is_flagged_with_a_warning() -> None:
    """Issue 46's pool: 640 blocks per engine, watermark 0.15 (96 kept). Without a
    guarantee, the sidecar admits at most 544 blocks beyond it on an engine, so a
    maxBlocks of 600 can never be reached: Accepted stays True, its reason says why."""
    fits = _status(544, guaranteed=0, capacity=640)
    never = _status(600, old=fits, guaranteed=0, capacity=640)
    accepted = _accepted(never)
    assert (accepted["status"], accepted["reason"]) == ("True", "MaxBlocksUnreachable")
    assert "maxBlocks is 600 blocks per engine" in accepted["message"]
    assert "gives this tenant at most 544" in accepted["message"]
    assert _accepted(fits)["reason"] == "Accepted"
    events = event_worthy("TenantQuota", fits, never)
    assert [(kind, reason) for kind, reason, _ in events] == [
        ("Warning", "MaxBlocksUnreachable")]
    # Two engines of 640 (the pool's capacity override is per engine): 1,200 pool-wide
    # is 600 per engine, unreachable too; 1,088 is 544 each.
    assert _accepted(_status(1200, guaranteed=0, capacity=640, replicas=2))["reason"] == (
        "MaxBlocksUnreachable")
    assert _accepted(_status(1088, guaranteed=0, capacity=640, replicas=2))["reason"] == (
        "Accepted")
    # A guarantee of 500 still leaves 544 the most beyond it: 600 unreachable.
    assert _accepted(_status(600, guaranteed=500, capacity=640))["reason"] == (
        "MaxBlocksUnreachable")
