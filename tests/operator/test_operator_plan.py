"""Planning a pool from its objects: admission order, exclusions, samples (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from operator_objects import pool, quota

from kvquota.policy.plan import PoolPlan, plan_pool

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def _plan(pool_body: dict[str, Any] | None, tenants: list[dict[str, Any]],
          replicas: int = 1, reported: tuple[int, ...] = ()) -> PoolPlan:
    return plan_pool(pool_body, tenants, namespace="default", name="demo-pool",
                     ready_replicas=replicas, reported_capacities=reported)


def _accepted(plan: PoolPlan, name: str) -> tuple[str, str]:
    want = (plan.tenants or {})[("default", name)].accepted
    return want.status, want.reason


def test_samples_render_one_policy_with_every_tier() -> None:
    docs = [d for p in sorted(SAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d and d.get("apiVersion") == "kvquota.dev/v1alpha1"]
    pool_doc = next(d for d in docs if d["kind"] == "InferencePool")
    tenants = [d for d in docs if d["kind"] == "TenantQuota"]
    plan = plan_pool(pool_doc, tenants, namespace="default", name="demo-pool",
                     ready_replicas=2)
    assert plan.policy is not None
    assert sorted(plan.policy.tenants) == ["acme", "globex", "hobbyist"]
    acme = plan.policy.tenants["acme"]
    assert (acme.guaranteed_blocks, acme.max_blocks_per_engine, acme.priority) == (128, 224, 0)
    assert plan.oversubscribed is False


def test_oversubscription_refuses_the_newest_by_creation_time_not_list_order() -> None:
    tenants = [
        quota("newest", guaranteed=400, maximum=500, created="2026-01-03T00:00:00Z"),
        quota("oldest", guaranteed=500, maximum=600, created="2026-01-01T00:00:00Z"),
        quota("middle", guaranteed=300, maximum=400, created="2026-01-02T00:00:00Z"),
    ]
    plan = _plan(pool(capacity=1000), tenants)  # 850 guaranteeable
    assert _accepted(plan, "oldest") == ("True", "Accepted")
    assert _accepted(plan, "middle") == ("True", "Accepted")
    assert _accepted(plan, "newest") == ("False", "Oversubscribed")
    assert plan.oversubscribed is True
    # The refused tenant keeps serving traffic, borrowing only.
    assert plan.policy is not None
    assert plan.policy.tenants["newest"].guaranteed_blocks == 0
    assert plan.policy.tenants["newest"].max_blocks_per_engine == 500
    assert plan.guaranteed_blocks == 800


def test_without_timestamps_file_order_decides() -> None:
    plan = _plan(pool(capacity=1000), [quota("first", guaranteed=600),
                                       quota("second", guaranteed=600)])
    assert _accepted(plan, "first")[0] == "True"
    assert _accepted(plan, "second") == ("False", "Oversubscribed")


def test_more_ready_replicas_admit_more() -> None:
    tenants = [quota("a", guaranteed=600), quota("b", guaranteed=600)]
    assert _accepted(_plan(pool(capacity=1000), tenants, replicas=2), "b")[0] == "True"


def test_capacity_from_the_smallest_engine_when_the_pool_sets_none() -> None:
    tenants = [quota("a", guaranteed=500)]
    plan = _plan(pool(capacity=None), tenants, replicas=2, reported=(400, 300))
    assert plan.capacity_per_engine == 300
    assert plan.budget == 510
    assert _accepted(plan, "a")[0] == "True"
    unknown = _plan(pool(capacity=None), tenants, replicas=0)
    assert _accepted(unknown, "a") == ("Unknown", "CapacityUnknown")
    assert unknown.policy is not None and "a" in unknown.policy.tenants


def test_duplicate_tenant_id_older_quota_wins() -> None:
    tenants = [quota("b", tenantId="acme", created="2026-01-02T00:00:00Z"),
               quota("a", tenantId="acme", created="2026-01-01T00:00:00Z")]
    plan = _plan(pool(), tenants)
    assert _accepted(plan, "a")[0] == "True"
    assert _accepted(plan, "b") == ("False", "DuplicateTenant")
    assert plan.policy is not None and list(plan.policy.tenants) == ["acme"]


def test_missing_pool_means_pool_not_found_for_every_quota() -> None:
    plan = _plan(None, [quota("a")])
    assert not plan.exists and plan.policy is None
    assert _accepted(plan, "a") == ("False", "PoolNotFound")


def test_invalid_quota_is_left_out_with_the_reason() -> None:
    bad = quota("bad")
    del bad["spec"]["tier"]
    plan = _plan(pool(), [bad, quota("good")])
    status, reason = _accepted(plan, "bad")
    assert (status, reason) == ("False", "InvalidSpec")
    assert "tier" in (plan.tenants or {})[("default", "bad")].accepted.message
    assert plan.policy is not None and list(plan.policy.tenants) == ["good"]


def test_name_too_long_for_a_tenant_id_asks_for_spec_tenant_id() -> None:
    plan = _plan(pool(), [quota("x" * 70)])
    want = (plan.tenants or {})[("default", "x" * 70)].accepted
    assert want.reason == "InvalidSpec"


def test_a_memo_kept_across_edits_plans_exactly_what_a_fresh_plan_does() -> None:
    """The operator keeps a PlanMemo per pool; replanning after each edit (guarantee up
    or down, a spec made invalid, a duplicate tenant id, a deletion, a pool change,
    a new replica count) must decide every quota as planning from scratch does."""
    from kvquota.policy.plan import PlanMemo

    ts = "2026-01-01T00:00:0{}Z"
    bodies = {n: quota(n, guaranteed=300, maximum=600, created=ts.format(i))
              for i, n in enumerate(["a", "b", "c", "d"])}
    pool_body = pool(capacity=1000)
    memo = PlanMemo()

    def replace(name: str, **kv_cache: Any) -> None:  # a new body, as kopf's index holds
        old = bodies[name]
        spec = {**old["spec"], "kvCache": {**old["spec"]["kvCache"], **kv_cache}}
        bodies[name] = {**old, "spec": spec}

    steps: list[Any] = [
        lambda: None,
        lambda: replace("a", guaranteedBlocks=100),  # c now fits
        lambda: replace("b", guaranteedBlocks=-5),  # invalid
        lambda: replace("b", guaranteedBlocks=50),
        lambda: bodies.__setitem__("d", {**bodies["d"], "spec": {
            **bodies["d"]["spec"], "tenantId": "a"}}),  # duplicate tenant id
        lambda: bodies.pop("a"),  # d now owns tenant id "a"
        lambda: pool_body["spec"]["kvCache"].update(capacityBlocks=500),
    ]
    for replicas, step in zip([1, 1, 2, 2, 3, 3, 1], steps, strict=True):
        step()
        tenants = sorted(bodies.values(), key=lambda b: b["metadata"]["name"])
        pool_now = {**pool_body, "spec": {**pool_body["spec"],
                                          "kvCache": dict(pool_body["spec"]["kvCache"])}}
        kept = plan_pool(pool_now, tenants, namespace="default", name="demo-pool",
                         ready_replicas=replicas, memo=memo)
        assert kept == _plan(pool_now, tenants, replicas=replicas)
    # The last step as a user sees it: 425 guaranteeable, b (50) + c (300) fit, d not;
    # c's maxBlocks (600) is above the shrunk pool's 500 blocks, which it is told.
    assert _accepted(kept, "c") == ("True", "MaxBlocksAboveCapacity")
    assert _accepted(kept, "d") == ("False", "Oversubscribed")


def test_a_pool_store_renders_its_address_and_each_tenants_pool_wide_quota() -> None:
    # A pool that names a store: its sidecars get the address, the password's key in
    # their secrets dir (never the password), and each tenant's pool-wide quota beside
    # its split, so they can admit beyond the split when the pool-wide total allows.
    store = {"address": "redis.infra:6379",
             "passwordSecretRef": {"name": "kvquota-store", "key": "redis-password"}}
    tenants = [quota("acme", guaranteed=400, maximum=800,
                     limits={"maxConcurrentRequests": 16})]
    plan = _plan(pool(capacity=1000, poolStore=store), tenants, replicas=8)
    assert plan.policy is not None and plan.policy.pool_store is not None
    assert plan.policy.pool_store.address == "redis.infra:6379"
    assert plan.policy.pool_store.password_file == "redis-password"
    acme = plan.policy.tenants["acme"]
    assert (acme.max_blocks_per_engine, acme.max_concurrent_requests) == (100, 2)
    assert acme.pool_wide is not None
    assert (acme.pool_wide.guaranteed_blocks, acme.pool_wide.max_blocks,
            acme.pool_wide.max_concurrent_requests) == (400, 800, 16)
    # Without a store the policy reads as before: neither field is in its JSON.
    plain = _plan(pool(capacity=1000), tenants, replicas=8).policy
    assert plain is not None
    text = plain.to_json()
    assert "poolStore" not in text and "poolWide" not in text
    assert '"poolWide"' in plan.policy.to_json()
