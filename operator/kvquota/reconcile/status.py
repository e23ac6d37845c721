"""Desired `.status` of InferencePools and TenantQuotas, and the minimal patch to it.

Pure: built from a `PoolPlan`, what the engines reported (`EngineView`; None in local
mode, where no engine is observed) and the previous status. Only fields declared in
the status models of `kvquota.api` are written. Messages depend only on the object's
own situation where possible, so one tenant's edit does not rewrite every status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine_sidecar.contract.policy import Tier
from engine_sidecar.contract.stats import TenantStatus
from kvquota.api import MAX_STATUS_ENGINES, ConditionReason, ConditionType, Counters, Usage
from kvquota.policy.conditions import Want, find, merge_conditions, timestamp
from kvquota.policy.plan import PoolPlan, TenantPlan
from kvquota.policy.resolve import effective_settings
from kvquota.reconcile.sync import PolicyHistory
from kvquota.reconcile.usage import Disruptions, PoolUsage
from kvquota.split.demand import tenant_engine_split

# Condition flips worth a Kubernetes Event (others change with every rollout).
EVENT_CONDITIONS = {"TenantQuota": (ConditionType.ACCEPTED, ConditionType.DEGRADED),
                    "InferencePool": (ConditionType.READY, ConditionType.OVERSUBSCRIBED)}
_NOT_REPORTED = TenantStatus()
# Condition states a user should look at: posted as Warning events.
BAD_STATES = {(ConditionType.ACCEPTED, "False"), (ConditionType.DEGRADED, "True"),
              (ConditionType.READY, "False"), (ConditionType.OVERSUBSCRIBED, "True"),
              (ConditionType.SYNCED, "False")}
# In a good state, but worth a Warning (local mode prints it too).
WARNING_REASONS = {ConditionReason.MAX_BLOCKS_ABOVE_CAPACITY,
                   ConditionReason.MAX_BLOCKS_UNREACHABLE}


@dataclass(frozen=True)
class EngineView:
    """The engines of one pool as the status needs them."""

    ready: int
    versions: Mapping[str, str | None]  # ready pod -> reported policy version (None: no report)
    matched: int = 0  # pods the selector matched, ready or not
    problem: Want | None = None  # why engines cannot be found (e.g. no gateway pool)
    errors: Mapping[str, str] = field(default_factory=dict)
    usage: PoolUsage = field(default_factory=PoolUsage)
    window_seconds: float = 300.0
    # ready pod -> its sidecar reached the pool's store (pods without a store: absent)
    store_reachable: Mapping[str, bool] = field(default_factory=dict)
    # ready pod -> why its sidecar does not use the store at all (its password missing)
    store_problems: Mapping[str, str] = field(default_factory=dict)

    def synced(self, version: str | None) -> int:
        return sum(1 for v in self.versions.values() if version and v == version)


def engine_split(tenant: TenantPlan, plan: PoolPlan,
                 engines: EngineView | None) -> list[tuple[str, int, int]]:
    """The tenant's (pod, guaranteed, maximum) on each ready engine, as its policy
    gives them (the first MAX_STATUS_ENGINES pods by name)."""
    if engines is None or plan.policy is None or tenant.policy is None:
        return []
    pods = sorted(engines.versions)[:MAX_STATUS_ENGINES]
    return tenant_engine_split(plan.policy, tenant.policy.tenant_id, pods)


def _window(seconds: float) -> str:
    return f"{seconds / 60:g}m" if seconds >= 60 else f"{seconds:g}s"


def _keep_or_unknown(old: Sequence[Mapping[str, Any]] | None, type_: ConditionType,
                     reason: ConditionReason, message: str) -> Want:
    before = find(old, type_)
    if before is None:
        return Want(type_, "Unknown", reason, message)
    return Want(type_, before.get("status", "Unknown"), before.get("reason") or reason,
                before.get("message") or "")


# ------------------------------------------------------------------ TenantQuota


def _tenant_ready(tenant: TenantPlan, plan: PoolPlan, engines: EngineView | None,
                  history: PolicyHistory | None) -> Want:
    if not plan.exists:
        return Want(ConditionType.READY, "False", ConditionReason.POOL_NOT_FOUND,
                    tenant.accepted.message)
    if plan.error is not None:
        return Want(ConditionType.READY, "False", ConditionReason.POOL_INVALID,
                    tenant.accepted.message)
    if tenant.policy is None or tenant.digest is None or tenant.tenant_id is None:
        return Want(ConditionType.READY, "False", tenant.accepted.reason,
                    "not part of the pool's policy: " + tenant.accepted.message)
    if engines is None:
        return Want(ConditionType.READY, "True", ConditionReason.POLICY_RENDERED,
                    "rendered into the pool's policy (engines are not observed in local mode)")
    if engines.ready == 0:
        return Want(ConditionType.READY, "False", ConditionReason.NO_READY_ENGINES,
                    f"no ready engine pod matches pool {plan.ref}")
    applied = (history or PolicyHistory()).applied_on(
        engines.versions.values(), tenant.tenant_id, tenant.digest
    )
    if applied == engines.ready:
        return Want(ConditionType.READY, "True", ConditionReason.APPLIED,
                    f"settings applied on all {engines.ready} ready engines")
    return Want(ConditionType.READY, "False", ConditionReason.NOT_SYNCED,
                f"settings applied on {applied} of {engines.ready} ready engines")


def _tenant_degraded(tenant: TenantPlan, plan: PoolPlan, engines: EngineView | None,
                     disruptions: Disruptions | None,
                     old: Sequence[Mapping[str, Any]] | None) -> Want:
    if not plan.exists:
        return Want(ConditionType.DEGRADED, "Unknown", ConditionReason.POOL_NOT_FOUND,
                    "the pool does not exist")
    if engines is None:
        return Want(ConditionType.DEGRADED, "Unknown", ConditionReason.NOT_OBSERVED,
                    "engines are not observed in local mode")
    if disruptions is None:
        return _keep_or_unknown(old, ConditionType.DEGRADED, ConditionReason.NO_DATA,
                                "waiting for engine reports")
    window = _window(engines.window_seconds)
    found: list[tuple[ConditionReason, str]] = []
    if disruptions.lease_breaks:
        found.append((ConditionReason.LEASE_BREAKS, f"{disruptions.lease_breaks} lease breaks"))
    if disruptions.preemptions and tenant.tier == Tier.PREMIUM:
        found.append((ConditionReason.PREMIUM_PREEMPTIONS,
                      f"{disruptions.preemptions} preemptions"))
    if disruptions.degraded_events:
        found.append((ConditionReason.DEGRADED_MODE,
                      f"{disruptions.degraded_events} degraded-mode releases"))
    if found:
        return Want(ConditionType.DEGRADED, "True", found[0][0],
                    ", ".join(text for _, text in found) + f" in the last {window}")
    if not disruptions.complete:
        return _keep_or_unknown(old, ConditionType.DEGRADED, ConditionReason.NO_DATA,
                                f"observing engines for the first {window}")
    return Want(ConditionType.DEGRADED, "False", ConditionReason.NO_DISRUPTIONS,
                f"no lease breaks or premium preemptions in the last {window}")


def tenant_status(
    tenant: TenantPlan,
    plan: PoolPlan,
    *,
    engines: EngineView | None,
    history: PolicyHistory | None = None,
    disruptions: Disruptions | None = None,
    old: Mapping[str, Any] | None,
    generation: int | None,
    now: datetime,
) -> dict[str, Any]:
    old = old or {}
    old_conditions = old.get("conditions")
    ready = _tenant_ready(tenant, plan, engines, history)
    wanted = [
        tenant.accepted,
        ready,
        _tenant_degraded(tenant, plan, engines, disruptions, old_conditions),
    ]
    conditions = merge_conditions(old_conditions, wanted, generation=generation, now=now)
    status: dict[str, Any] = {"observedGeneration": generation, "conditions": conditions}
    if tenant.resolved is not None:
        status["effective"] = effective_settings(tenant.resolved).model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
    if engines is not None and tenant.tenant_id is not None and plan.exists:
        seen = engines.usage.tenants.get(tenant.tenant_id) or _NOT_REPORTED
        status["usage"] = Usage.of(seen.usage).model_dump(by_alias=True)
        status["counters"] = Counters.of(seen.counters).model_dump(by_alias=True)
        status["engines"] = [
            {"pod": pod, "guaranteedBlocks": guaranteed, "maxBlocks": maximum}
            for pod, guaranteed, maximum in engine_split(tenant, plan, engines)
        ] or None
    was_ready = (find(old_conditions, ConditionType.READY) or {}).get("status") == "True"
    if ready.status == "True" and not was_ready:
        status["lastSyncTime"] = timestamp(now)
    elif old.get("lastSyncTime"):
        status["lastSyncTime"] = old["lastSyncTime"]
    return {k: v for k, v in status.items() if v is not None}


# ------------------------------------------------------------------ InferencePool


def _pool_ready(plan: PoolPlan, engines: EngineView | None) -> Want:
    if plan.error is not None:
        return Want(ConditionType.READY, "False", ConditionReason.INVALID_SPEC, plan.error)
    if engines is None:
        return Want(ConditionType.READY, "True", ConditionReason.POLICY_RENDERED,
                    "policy rendered (engines are not observed in local mode)")
    if engines.problem is not None:
        return engines.problem
    if engines.matched == 0:
        return Want(ConditionType.READY, "False", ConditionReason.NO_ENGINES,
                    "the pool's selector matches no engine pod")
    if engines.ready == 0:
        return Want(ConditionType.READY, "False", ConditionReason.ENGINES_NOT_READY,
                    f"{engines.matched} engine pods, none ready")
    return Want(ConditionType.READY, "True", ConditionReason.ENGINES_READY,
                f"{engines.ready} of {engines.matched} engine pods ready")


def _pool_synced(plan: PoolPlan, engines: EngineView | None) -> Want:
    version = plan.policy.version if plan.policy else None
    if engines is None:
        return Want(ConditionType.SYNCED, "Unknown", ConditionReason.NOT_OBSERVED,
                    "engines are not observed in local mode")
    if version is None:
        return Want(ConditionType.SYNCED, "Unknown", ConditionReason.NO_POLICY,
                    "no policy could be rendered")
    if engines.ready == 0:
        return Want(ConditionType.SYNCED, "Unknown", ConditionReason.NO_READY_ENGINES,
                    "no ready engines to sync")
    synced = engines.synced(version)
    if synced == engines.ready:
        return Want(ConditionType.SYNCED, "True", ConditionReason.ALL_ENGINES_SYNCED,
                    f"all {engines.ready} ready engines run policy {version}")
    lagging = []
    for pod, reported in sorted(engines.versions.items()):
        if reported != version:
            why = engines.errors.get(pod) or f"runs {reported or 'no policy'}"
            lagging.append(f"{pod}: {why}")
    return Want(ConditionType.SYNCED, "False", ConditionReason.ENGINES_NOT_SYNCED,
                f"{synced} of {engines.ready} ready engines run policy {version}; "
                + "; ".join(lagging[:5]))


def _pool_oversubscribed(plan: PoolPlan) -> Want:
    if plan.error is not None:
        return Want(ConditionType.OVERSUBSCRIBED, "Unknown", ConditionReason.INVALID_SPEC,
                    plan.error)
    if plan.budget is None:
        return Want(ConditionType.OVERSUBSCRIBED, "Unknown", ConditionReason.CAPACITY_UNKNOWN,
                    "KV capacity unknown: set spec.kvCache.capacityBlocks or wait for "
                    "ready engines to report it")
    if plan.oversubscribed:
        names = ", ".join(f"{t.key[0]}/{t.key[1]}" for t in plan.rejected[:10])
        return Want(
            ConditionType.OVERSUBSCRIBED, "True", ConditionReason.GUARANTEES_EXCEED_CAPACITY,
            f"TenantQuotas ask {plan.requested_blocks} guaranteed blocks, the pool can "
            f"guarantee {plan.budget} ({plan.capacity_blocks} x (1 - watermark "
            f"{plan.watermark:g})); not accepted (newest first to wait): {names}",
        )
    return Want(ConditionType.OVERSUBSCRIBED, "False", ConditionReason.WITHIN_CAPACITY,
                f"{plan.guaranteed_blocks} of {plan.budget} guaranteeable blocks guaranteed")


def _pool_store_degraded(engines: EngineView | None) -> Want:
    """Written only for pools that name a store."""
    if engines is None or not engines.store_reachable:
        return Want(ConditionType.STORE_DEGRADED, "Unknown", ConditionReason.NOT_OBSERVED,
                    "no engine has reported on the pool's store yet")
    down = sorted(pod for pod, ok in engines.store_reachable.items() if not ok)
    if down:
        why = sorted(set(engines.store_problems.values()))
        return Want(ConditionType.STORE_DEGRADED, "True", ConditionReason.STORE_UNREACHABLE,
                    f"{len(down)} of {len(engines.store_reachable)} engines cannot reach the "
                    f"pool's store and admit only what they had claimed of their split: "
                    + ", ".join(down[:5]) + "".join(f"; {problem}" for problem in why[:2]))
    return Want(ConditionType.STORE_DEGRADED, "False", ConditionReason.STORE_REACHABLE,
                f"all {len(engines.store_reachable)} reporting engines reach the pool's store")


def pool_status(
    plan: PoolPlan,
    *,
    engines: EngineView | None,
    old: Mapping[str, Any] | None,
    generation: int | None,
    now: datetime,
) -> dict[str, Any]:
    old = old or {}
    wanted = [_pool_ready(plan, engines), _pool_synced(plan, engines),
              _pool_oversubscribed(plan)]
    if plan.policy is not None and plan.policy.pool_store is not None:
        wanted.append(_pool_store_degraded(engines))
    version = plan.policy.version if plan.policy else None
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(
            old.get("conditions"), wanted, generation=generation, now=now
        ),
        "engines": {
            "ready": engines.ready if engines else 0,
            "synced": engines.synced(version) if engines else 0,
        },
        "capacityBlocks": plan.capacity_blocks,
        "guaranteedBlocks": plan.guaranteed_blocks,
        "tenants": len(plan.policy.tenants) if plan.policy else 0,
        "policyHash": version,
    }
    if engines is not None:
        status["usedBlocks"] = engines.usage.used_blocks
        status["leasedBlocks"] = engines.usage.leased_blocks
    return {k: v for k, v in status.items() if v is not None}


# ------------------------------------------------------------------ patching


TENANT_FIELDS = ("observedGeneration", "conditions", "effective", "usage", "counters",
                 "engines", "lastSyncTime")
POOL_FIELDS = ("observedGeneration", "conditions", "engines", "capacityBlocks",
               "guaranteedBlocks", "usedBlocks", "leasedBlocks", "tenants", "policyHash")


def status_patch(
    old: Mapping[str, Any] | None, new: Mapping[str, Any], owned: Sequence[str]
) -> dict[str, Any] | None:
    """A merge patch of `.status` holding only the top-level fields that changed, and
    nulls for owned fields no longer wanted (None: nothing to write). Lists such as
    conditions are always sent whole (merge patches replace lists)."""
    old = old or {}
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in owned if k in old and k not in new})
    return patch or None


def event_worthy(kind: str, old: Mapping[str, Any] | None,
                 new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the condition changes a user should see as Events:
    flips of the kind's EVENT_CONDITIONS, and their first appearance in a bad state."""
    events = []
    for condition in new.get("conditions") or []:
        type_, state = condition.get("type"), condition.get("status")
        if type_ not in EVENT_CONDITIONS.get(kind, ()):
            continue
        before = find((old or {}).get("conditions"), str(type_))
        warned = condition.get("reason") in WARNING_REASONS
        bad = (type_, state) in BAD_STATES or warned
        if before is None and not bad:
            continue
        if before is not None and before.get("status") == state and not (
            warned and before.get("reason") != condition.get("reason")
        ):
            continue
        events.append(("Warning" if bad else "Normal", str(condition.get("reason")),
                       f"{type_}={state}: {condition.get('message')}"))
    return events
