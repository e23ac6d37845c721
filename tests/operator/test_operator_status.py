"""Status conditions and patches (pure)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from operator_objects import condition, pool, quota

from engine_sidecar.contract.stats import SidecarStatus, TenantCounters, TenantStatus, TenantUsage
from kvquota.api import (
    CONDITION_REASON_PATTERN,
    CONDITION_TYPE_PATTERN,
    ConditionReason,
    ConditionType,
    Counters,
    Usage,
)
from kvquota.policy.conditions import Want, merge_conditions
from kvquota.policy.plan import PoolPlan, plan_pool
from kvquota.reconcile.status import (
    TENANT_FIELDS,
    EngineView,
    event_worthy,
    pool_status,
    status_patch,
    tenant_status,
)
from kvquota.reconcile.sync import PolicyHistory
from kvquota.reconcile.usage import Disruptions, aggregate

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _plan(*tenants: dict, capacity: int = 1000, replicas: int = 1) -> PoolPlan:
    return plan_pool(pool(capacity=capacity), list(tenants), namespace="default",
                     name="demo-pool", ready_replicas=replicas)


def test_transition_time_moves_only_on_a_flip() -> None:
    first = merge_conditions(None, [Want("Ready", "False", "NotSynced", "1 of 2")],
                             generation=1, now=T0)
    later = T0 + timedelta(minutes=5)
    same = merge_conditions(first, [Want("Ready", "False", "NotSynced", "0 of 2")],
                            generation=2, now=later)
    flipped = merge_conditions(same, [Want("Ready", "True", "Applied", "")],
                               generation=2, now=later)
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_first_visit_sets_every_condition_even_unknown() -> None:
    plan = _plan(quota("a", guaranteed=10))
    tenant = (plan.tenants or {})[("default", "a")]
    status = tenant_status(tenant, plan, engines=EngineView(ready=0, versions={}),
                           old=None, generation=3, now=T0)
    assert [c["type"] for c in status["conditions"]] == ["Accepted", "Ready", "Degraded"]
    assert condition(status, "Degraded")["status"] == "Unknown"
    assert condition(status, "Ready")["reason"] == "NoReadyEngines"
    assert status["observedGeneration"] == 3
    assert status["effective"]["guaranteedBlocks"] == 10


def test_tenant_ready_survives_another_tenants_change_while_engines_reload() -> None:
    history = PolicyHistory()
    before = _plan(quota("a", guaranteed=10), quota("b", guaranteed=10))
    after = _plan(quota("a", guaranteed=10), quota("b", guaranteed=20))  # only b changed
    assert before.policy is not None and after.policy is not None
    history.record(before.policy)
    history.record(after.policy)
    engines = EngineView(ready=2, versions={"e1": before.policy.version,
                                            "e2": after.policy.version})

    def ready(name: str) -> str:
        tenant = (after.tenants or {})[("default", name)]
        status = tenant_status(tenant, after, engines=engines, history=history, old=None,
                               generation=1, now=T0)
        return str(condition(status, "Ready")["status"])

    assert ready("a") == "True"  # both versions carry a's current settings
    assert ready("b") == "False"  # e1 still runs b's old quota


def test_pool_synced_only_when_every_ready_engine_runs_the_current_hash() -> None:
    plan = _plan(quota("a"))
    assert plan.policy is not None
    current = plan.policy.version
    behind = EngineView(ready=2, matched=2, versions={"e1": current, "e2": "sha256:old"})
    status = pool_status(plan, engines=behind, old=None, generation=1, now=T0)
    assert condition(status, "Synced")["status"] == "False"
    assert "e2: runs sha256:old" in condition(status, "Synced")["message"]
    assert status["engines"] == {"ready": 2, "synced": 1}
    caught_up = EngineView(ready=2, matched=2, versions={"e1": current, "e2": current})
    status = pool_status(plan, engines=caught_up, old=status, generation=1, now=T0)
    assert condition(status, "Synced")["status"] == "True"
    assert status["policyHash"] == current


def test_pool_reports_capacity_and_oversubscription() -> None:
    plan = _plan(quota("a", guaranteed=900), capacity=1000, replicas=2)
    engines = EngineView(ready=2, matched=3, versions={"e1": None, "e2": None},
                         usage=aggregate([SidecarStatus(ready=True, total_blocks=1000,
                                                        free_blocks=600)]))
    status = pool_status(plan, engines=engines, old=None, generation=1, now=T0)
    assert status["capacityBlocks"] == 2000
    assert status["guaranteedBlocks"] == 900
    assert status["usedBlocks"] == 400
    assert condition(status, "Oversubscribed")["status"] == "False"
    assert condition(status, "Ready")["message"] == "2 of 3 engine pods ready"
    tight = _plan(quota("a", guaranteed=900), capacity=1000, replicas=1)
    status = pool_status(tight, engines=engines, old=None, generation=1, now=T0)
    assert condition(status, "Oversubscribed")["status"] == "True"
    assert "default/a" in condition(status, "Oversubscribed")["message"]


def _degraded(tier: str, disruptions: Disruptions | None, old: dict | None = None) -> dict:
    plan = _plan(quota("a", tier=tier))
    tenant = (plan.tenants or {})[("default", "a")]
    status = tenant_status(tenant, plan, engines=EngineView(ready=1, versions={"e": None}),
                           disruptions=disruptions, old=old, generation=1, now=T0)
    return condition(status, "Degraded")


def test_degraded_on_lease_breaks_or_premium_preemptions_in_the_window() -> None:
    assert _degraded("free", Disruptions(2, 0, 0, complete=False))["reason"] == "LeaseBreaks"
    assert _degraded("premium", Disruptions(0, 1, 0, complete=True))["status"] == "True"
    assert _degraded("free", Disruptions(0, 5, 0, complete=True))["status"] == "False"


def test_degraded_is_not_cleared_before_the_window_was_observed() -> None:
    # After a restart, a quiet first poll must not clear an earlier Degraded=True.
    old = {"conditions": [{"type": "Degraded", "status": "True", "reason": "LeaseBreaks",
                           "message": "1 lease breaks", "lastTransitionTime": "x"}]}
    assert _degraded("premium", Disruptions(0, 0, 0, complete=False), old)["status"] == "True"
    assert _degraded("premium", Disruptions(0, 0, 0, complete=True), old)["status"] == "False"


def test_usage_and_counters_come_from_the_engines() -> None:
    plan = _plan(quota("a"))
    tenant = (plan.tenants or {})[("default", "a")]
    report = SidecarStatus(ready=True, tenants={"a": TenantStatus(
        counters=TenantCounters(admitted=7, rejected_quota=2))})
    engines = EngineView(ready=2, versions={"e1": None, "e2": None},
                         usage=aggregate([report, report]))
    status = tenant_status(tenant, plan, engines=engines, old=None, generation=1, now=T0)
    assert status["counters"]["admitted"] == 14
    assert status["counters"]["rejectedQuota"] == 4


def test_patch_holds_only_what_changed() -> None:
    plan = _plan(quota("a"))
    tenant = (plan.tenants or {})[("default", "a")]
    engines = EngineView(ready=0, versions={})
    first = tenant_status(tenant, plan, engines=engines, old=None, generation=1, now=T0)
    assert status_patch(None, first, TENANT_FIELDS) == first
    again = tenant_status(tenant, plan, engines=engines, old=first, generation=1,
                          now=T0 + timedelta(hours=1))
    assert status_patch(first, again, TENANT_FIELDS) is None
    bumped = tenant_status(tenant, plan, engines=engines, old=first, generation=2, now=T0)
    assert set(status_patch(first, bumped, TENANT_FIELDS) or {}) == {
        "observedGeneration", "conditions"}


def test_events_for_refusals_and_recoveries_not_for_routine_success() -> None:
    plan = _plan(quota("a", guaranteed=10))
    tenant = (plan.tenants or {})[("default", "a")]
    engines = EngineView(ready=0, versions={})
    fine = tenant_status(tenant, plan, engines=engines, old=None, generation=1, now=T0)
    assert event_worthy("TenantQuota", None, fine) == []
    tight = _plan(quota("a", guaranteed=10), capacity=5)
    refused = tenant_status((tight.tenants or {})[("default", "a")], tight, engines=engines,
                            old=fine, generation=1, now=T0)
    ((kind, reason, _),) = event_worthy("TenantQuota", fine, refused)
    assert (kind, reason) == ("Warning", "Oversubscribed")


def test_tenant_status_shows_reserved_vs_held_the_estimate_and_outgrown_preemptions() -> None:
    plan = _plan(quota("a"))
    tenant = (plan.tenants or {})[("default", "a")]

    def engine(held: int, reserved: int, estimate: int, outgrown: int) -> SidecarStatus:
        return SidecarStatus(ready=True, tenants={"a": TenantStatus(
            usage=TenantUsage(blocks=held, reserved_blocks=reserved,
                              pending_blocks=max(0, reserved - held),
                              charged_blocks=max(reserved, held),
                              output_estimate_tokens=estimate),
            counters=TenantCounters(preemptions=outgrown + 1, outgrown_preemptions=outgrown))})

    engines = EngineView(ready=2, versions={"e1": None, "e2": None},
                         usage=aggregate([engine(40, 30, 220, 1), engine(10, 25, 180, 0)]))
    status = tenant_status(tenant, plan, engines=engines, old=None, generation=1, now=T0)
    usage = status["usage"]
    assert (usage["blocks"], usage["reservedBlocks"]) == (50, 55)
    # One engine's requests decoded past their estimates (40 held, 30 reserved): charged
    # what they hold; the other still has 15 blocks reserved and not allocated.
    assert (usage["chargedBlocks"], usage["pendingBlocks"]) == (65, 15)
    assert usage["outputEstimateTokens"] == 220  # per request: the largest engine's
    assert status["counters"]["outgrownPreemptions"] == 1


def test_condition_names_are_valid_and_written_as_plain_strings() -> None:
    assert all(re.fullmatch(CONDITION_TYPE_PATTERN, t) for t in ConditionType)
    assert all(re.fullmatch(CONDITION_REASON_PATTERN, r) for r in ConditionReason)
    plan = _plan(quota("a", guaranteed=10), capacity=5)
    tenant = (plan.tenants or {})[("default", "a")]
    status = tenant_status(tenant, plan, engines=EngineView(ready=0, versions={}),
                           old=None, generation=1, now=T0)
    assert {(type(c["type"]), type(c["reason"])) for c in status["conditions"]} == {(str, str)}
    assert condition(status, "Accepted")["reason"] == ConditionReason.OVERSUBSCRIBED
    assert "Oversubscribed" in yaml.safe_dump(status)  # as local mode writes it


def test_usage_and_counters_are_views_of_the_wire_models() -> None:
    """The status shows the sidecars' figures by name, without a list of keys to keep."""
    assert set(Usage.model_fields) == set(TenantUsage.model_fields)
    assert set(Counters.model_fields) == set(TenantCounters.model_fields) - {"degraded_events"}
    shown = Counters.of(TenantCounters(admitted=3, lease_breaks=1, degraded_events=2))
    assert shown.model_dump(by_alias=True) == {
        "admitted": 3, "rejectedQuota": 0, "rejectedWatermark": 0, "preemptions": 0,
        "outgrownPreemptions": 0, "leaseBreaks": 1}
    with pytest.raises(TypeError):
        Counters.of(TenantUsage())
    with pytest.raises(TypeError, match="unreported"):
        class _Wrong(Counters):  # a status field the sidecars do not report
            unreported: int = 0


def test_a_pool_with_a_store_says_when_an_engine_cannot_reach_it() -> None:
    # Only pools that name a store carry StoreDegraded; an engine whose sidecar reports
    # its store unreachable turns it True, naming the pod.
    store = {"address": "redis.infra:6379"}
    plan = plan_pool(pool(capacity=1000, poolStore=store), [quota("a")], namespace="default",
                     name="demo-pool", ready_replicas=2)
    assert plan.policy is not None
    version = plan.policy.version
    versions = {"e1": version, "e2": version}
    down = EngineView(ready=2, matched=2, versions=versions,
                      store_reachable={"e1": True, "e2": False})
    status = pool_status(plan, engines=down, old=None, generation=1, now=T0)
    degraded = condition(status, "StoreDegraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "StoreUnreachable")
    assert "e2" in degraded["message"] and "e1" not in degraded["message"]
    # A sidecar that cannot use the store at all (its password Secret not mounted) says
    # why, and the condition repeats it: the fix is in the pod's spec, not the network.
    problem = "the store's password (key password) is not mounted"
    unmounted = EngineView(ready=2, matched=2, versions=versions,
                           store_reachable={"e1": True, "e2": False},
                           store_problems={"e2": problem})
    degraded = condition(pool_status(plan, engines=unmounted, old=None, generation=1, now=T0),
                         "StoreDegraded")
    assert degraded["status"] == "True" and degraded["message"].endswith(f"e2; {problem}")
    up = EngineView(ready=2, matched=2, versions=versions,
                    store_reachable={"e1": True, "e2": True})
    status = pool_status(plan, engines=up, old=status, generation=1, now=T0)
    assert condition(status, "StoreDegraded")["status"] == "False"
    plain = _plan(quota("a"))
    status = pool_status(plain, engines=up, old=None, generation=1, now=T0)
    assert "StoreDegraded" not in {c["type"] for c in status["conditions"]}
