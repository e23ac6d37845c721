"""Conditions on the kinds' status: the metav1.Condition model, and every condition
type and reason the operator writes.

One module owns the names, which alerts, dashboards and Argo CD health checks match
(tests/foundation/frozen_names.yaml freezes them).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from kvquota.api.meta import ApiModel

CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)


CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class ConditionType(StrEnum):
    """The condition types the operator writes (`Condition.type`); each kind carries all
    of its own from the first reconcile."""

    ACCEPTED = "Accepted"
    """TenantQuota: the guarantee fits the pool (or no capacity is known yet: Unknown)."""
    READY = "Ready"
    """TenantQuota: the settings run on every ready engine. InferencePool: engine pods
    are found and ready."""
    DEGRADED = "Degraded"
    """TenantQuota: lease breaks, premium preemptions or degraded-mode releases in the
    recent window."""
    SYNCED = "Synced"
    """InferencePool: every ready engine runs the current policy."""
    OVERSUBSCRIBED = "Oversubscribed"
    """InferencePool: the TenantQuotas ask for more guaranteed blocks than the pool can
    guarantee."""
    STORE_DEGRADED = "StoreDegraded"
    """InferencePool with spec.poolStore: some ready engine's sidecar cannot reach the
    store, so it admits only what it had claimed of its split."""


class ConditionReason(StrEnum):
    """Why a condition has its status (`Condition.reason`): every reason the operator
    writes, grouped by the condition types that use it."""

    # Accepted (TenantQuota)
    ACCEPTED = "Accepted"
    """The guarantee is reserved in the pool."""
    MAX_BLOCKS_ABOVE_CAPACITY = "MaxBlocksAboveCapacity"
    """Accepted, but maxBlocks exceeds the pool's capacity, which is the real limit
    (posted as a Warning event)."""
    MAX_BLOCKS_UNREACHABLE = "MaxBlocksUnreachable"
    """Accepted, but the per-engine maxBlocks is above what an engine can ever give the
    tenant (beyond its guarantee, the blocks above the watermark); posted as a Warning
    event."""
    OVERSUBSCRIBED = "Oversubscribed"
    """The guarantee does not fit what older quotas left; the quota borrows only."""
    DUPLICATE_TENANT = "DuplicateTenant"
    """An older TenantQuota of the pool already uses the tenantId."""
    CAPACITY_UNKNOWN = "CapacityUnknown"
    """The pool's KV capacity is not known yet (Accepted and Oversubscribed: Unknown)."""

    # The object or its pool (Accepted, Ready, Oversubscribed)
    INVALID_SPEC = "InvalidSpec"
    """The object's spec (or the tenant's policy entry) does not validate."""
    POOL_NOT_FOUND = "PoolNotFound"
    """The TenantQuota's pool does not exist."""
    POOL_INVALID = "PoolInvalid"
    """The TenantQuota's pool has an invalid spec."""

    # Ready
    POLICY_RENDERED = "PolicyRendered"
    """Local mode: the policy is rendered; engines are not observed."""
    APPLIED = "Applied"
    """TenantQuota: its settings run on every ready engine."""
    NOT_SYNCED = "NotSynced"
    """TenantQuota: some ready engines do not run its settings yet."""
    NO_READY_ENGINES = "NoReadyEngines"
    """TenantQuota Ready, InferencePool Synced: no engine pod of the pool is ready."""
    NO_ENGINES = "NoEngines"
    """InferencePool: the selector matches no engine pod."""
    ENGINES_NOT_READY = "EnginesNotReady"
    """InferencePool: engine pods exist, none is ready."""
    ENGINES_READY = "EnginesReady"
    """InferencePool: some engine pods are ready."""
    GATEWAY_POOL_NOT_FOUND = "GatewayPoolNotFound"
    """InferencePool: the Gateway API InferencePool of spec.gatewayPoolRef is missing."""
    GATEWAY_POOL_INVALID = "GatewayPoolInvalid"
    """InferencePool: the Gateway API InferencePool has no label selector."""

    # Synced (InferencePool)
    ALL_ENGINES_SYNCED = "AllEnginesSynced"
    """Every ready engine runs the current policy."""
    ENGINES_NOT_SYNCED = "EnginesNotSynced"
    """Some ready engines run another policy, or none."""
    NO_POLICY = "NoPolicy"
    """No policy could be rendered."""
    NOT_OBSERVED = "NotObserved"
    """Local mode: engines are not observed (also Degraded)."""

    # Degraded (TenantQuota)
    NO_DATA = "NoData"
    """The engines have not reported for a whole window yet."""
    LEASE_BREAKS = "LeaseBreaks"
    """Leases were broken to free KV blocks in the window."""
    PREMIUM_PREEMPTIONS = "PremiumPreemptions"
    """A premium tenant's requests were preempted in the window."""
    DEGRADED_MODE = "DegradedMode"
    """Engines released the tenant's blocks in degraded mode in the window."""
    NO_DISRUPTIONS = "NoDisruptions"
    """None of the above in the window."""

    # Oversubscribed (InferencePool)
    GUARANTEES_EXCEED_CAPACITY = "GuaranteesExceedCapacity"
    """The TenantQuotas ask for more guaranteed blocks than the pool can guarantee."""
    WITHIN_CAPACITY = "WithinCapacity"
    """Every guarantee asked for fits."""

    # StoreDegraded (InferencePool)
    STORE_REACHABLE = "StoreReachable"
    """Every ready engine that reported reached the pool's store."""
    STORE_UNREACHABLE = "StoreUnreachable"
    """Some engine's sidecar could not reach the store within its timeout."""


class Condition(ApiModel):
    """One aspect of the object's state, as metav1.Condition."""

    type: str = Field(
        max_length=316, pattern=CONDITION_TYPE_PATTERN,
        description="The aspect the condition reports, in CamelCase (e.g. Ready).",
    )
    status: Literal["True", "False", "Unknown"] = Field(
        description="True, False, or Unknown when the operator cannot tell yet."
    )
    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation the condition was computed from."
    )
    last_transition_time: datetime = Field(
        description="When status last changed (not when the condition was last checked)."
    )
    reason: str = Field(
        min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN,
        description="Why the condition has its status: one CamelCase word, for programs.",
    )
    message: str = Field(
        "", max_length=32768, description="The reason explained for people; may be empty."
    )


Conditions = Annotated[
    list[Condition],
    Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    ),
]
