"""Plan one pool: from the pool object, every TenantQuota that references it and what
the engines reported, decide each quota's admission and effective settings and render
the pool's EnginePolicy.

Pure and deterministic (same inputs, same plan), so the operator can recompute it
from its caches after any event or restart, and local mode runs exactly the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from engine_sidecar.contract.errors import problems
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy, Tier
from engine_sidecar.contract.reclaim import watermark_floor
from kvquota.api import (
    ConditionReason,
    ConditionType,
    InferencePoolSpec,
    ObjectMeta,
    QuotaSplit,
    TenantQuotaSpec,
)
from kvquota.policy.conditions import Want
from kvquota.policy.render import RenderedPolicy, RenderedTenant, compose_policy, render_tenant
from kvquota.policy.resolve import ResolvedTenant, resolve_tenant, tenant_policy
from kvquota.split.capacity import (
    Admission,
    admit_oldest_first,
    engine_capacity,
    guaranteeable_blocks,
)
from kvquota.split.demand import SplitInputs, Splits, engine_overrides
from kvquota.split.rebalance import TenantTotals

ObjKey = tuple[str, str]  # (namespace, name)
_T = TypeVar("_T")


def describe_errors(error: ValidationError, prefix: str = "spec") -> str:
    """One line for a condition's message: every problem, `path: message`, in the shared
    wording (no input values echoed)."""
    return "; ".join(problems(error, prefix=prefix, top=prefix))


@dataclass(frozen=True)
class TenantPlan:
    key: ObjKey
    tenant_id: str | None
    tier: Tier | None
    accepted: Want
    resolved: ResolvedTenant | None = None
    policy: TenantPolicy | None = None  # None: not in the pool's policy
    digest: str | None = None


@dataclass(frozen=True)
class PoolPlan:
    namespace: str
    name: str
    exists: bool
    error: str | None = None  # the pool's spec cannot be rendered
    replicas: int = 1  # ready replicas the quotas are split over (at least 1)
    capacity_per_engine: int | None = None
    budget: int | None = None  # pool-wide guaranteeable blocks
    requested_blocks: int = 0  # sum of guarantees asked by valid, distinct quotas
    guaranteed_blocks: int = 0  # sum of guarantees granted
    watermark: float = 0.0
    rendered: RenderedPolicy | None = None  # the policy and its JSON
    tenants: Mapping[ObjKey, TenantPlan] | None = None
    demand_split: bool = False  # spec.quotaSplit: Demand

    @property
    def policy(self) -> EnginePolicy | None:
        return self.rendered.policy if self.rendered is not None else None

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def capacity_blocks(self) -> int | None:
        if self.capacity_per_engine is None:
            return None
        return self.capacity_per_engine * self.replicas

    @property
    def oversubscribed(self) -> bool | None:
        if self.budget is None:
            return None
        return self.requested_blocks > self.budget

    @property
    def digests(self) -> dict[str, str]:
        """Tenant id -> digest of its settings in this plan's policy."""
        return {t.tenant_id: t.digest for t in (self.tenants or {}).values()
                if t.tenant_id and t.digest and t.policy is not None}

    @property
    def split_inputs(self) -> SplitInputs:
        """What the demand-driven split needs of this plan: each tenant in the policy
        with its pool-wide granted guarantee and ceiling."""
        tenants = [
            TenantTotals(t.tenant_id, t.resolved.guaranteed_blocks, t.resolved.max_blocks,
                         t.policy.priority)
            for t in (self.tenants or {}).values()
            if t.tenant_id and t.policy is not None and t.resolved is not None
        ]
        return SplitInputs(sorted(tenants, key=lambda t: t.tenant_id),
                           self.capacity_per_engine if self.exists else None, self.watermark)

    @property
    def rejected(self) -> list[TenantPlan]:
        return [
            t for t in (self.tenants or {}).values()
            if t.accepted.reason == ConditionReason.OVERSUBSCRIBED
        ]


@dataclass(frozen=True)
class _Quota:
    key: ObjKey
    tenant_id: str
    spec: TenantQuotaSpec


def _meta(body: Mapping[str, Any]) -> ObjectMeta:
    return ObjectMeta.model_validate(body.get("metadata") or {})


def _key(body: Mapping[str, Any]) -> ObjKey:
    meta = body.get("metadata") or {}
    return (str(meta.get("namespace") or "default"), str(meta.get("name")))


def _created(body: Mapping[str, Any]) -> datetime | None:
    try:
        created = _meta(body).creation_timestamp
    except ValidationError:
        return None
    if created is not None and created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    return created


_Entry = tuple[ResolvedTenant, RenderedTenant] | ValidationError


@dataclass
class PlanMemo:
    """What `plan_pool` derived per object last time, reused while its inputs are
    unchanged, so re-planning a pool after one quota's edit parses and resolves that
    quota only, and serialises that quota's policy entry only. Keyed by object; an
    entry holds the inputs it was derived from and is reused only when they compare
    equal (so a memo never changes a plan, only its cost). Objects missing from a plan
    are dropped from the memo. Inputs are held by reference: a caller that keeps a
    memo must replace bodies, not edit them in place (kopf's indices hold a fresh
    snapshot per event)."""

    _pool: tuple[Any, InferencePoolSpec | ValidationError] | None = None
    _specs: dict[ObjKey, tuple[Any, TenantQuotaSpec | ValidationError]] = field(
        default_factory=dict)
    _created: dict[ObjKey, tuple[Any, datetime | None]] = field(default_factory=dict)
    _entries: dict[ObjKey, tuple[tuple[Any, ...], _Entry]] = field(default_factory=dict)
    _plans: dict[ObjKey, tuple[tuple[Any, ...], TenantPlan]] = field(default_factory=dict)

    def parse_pool(self, pool: Mapping[str, Any]) -> InferencePoolSpec | ValidationError:
        """The pool's spec, or why it is invalid (parsed again only when it changed)."""
        raw = pool.get("spec") or {}
        if self._pool is None or self._pool[0] != raw:
            try:
                parsed: InferencePoolSpec | ValidationError = (
                    InferencePoolSpec.model_validate(raw))
            except ValidationError as error:
                parsed = error
            self._pool = (raw, parsed)
        return self._pool[1]

    def quota_spec(self, key: ObjKey, raw: Any) -> TenantQuotaSpec:
        known = self._specs.get(key)
        if known is None or (known[0] is not raw and known[0] != raw):
            try:
                parsed: TenantQuotaSpec | ValidationError = TenantQuotaSpec.model_validate(raw)
            except ValidationError as error:
                parsed = error
            known = self._specs[key] = (raw, parsed)
        if isinstance(known[1], ValidationError):
            raise known[1]
        return known[1]

    def created(self, key: ObjKey, body: Mapping[str, Any]) -> datetime | None:
        raw = (body.get("metadata") or {}).get("creationTimestamp")
        known = self._created.get(key)
        if known is None or known[0] != raw:
            known = self._created[key] = (raw, _created(body))
        return known[1]

    def entry(self, key: ObjKey, inputs: tuple[Any, ...], derive: Callable[[], _Entry]
              ) -> _Entry:
        return _reuse(self._entries, key, inputs, derive)

    def tenant_plan(self, key: ObjKey, inputs: tuple[Any, ...],
                    build: Callable[[], TenantPlan]) -> TenantPlan:
        """The same TenantPlan object while its inputs are the same: the status stage
        compares plans, and identity makes that cheap."""
        return _reuse(self._plans, key, inputs, build)

    def keep_only(self, keys: set[ObjKey]) -> None:
        for table in (self._specs, self._created, self._entries, self._plans):
            for gone in [k for k in table if k not in keys]:
                del table[gone]


def _reuse(table: dict[ObjKey, tuple[tuple[Any, ...], _T]], key: ObjKey,
           inputs: tuple[Any, ...], derive: Callable[[], _T]) -> _T:
    known = table.get(key)
    # Tuple equality compares items by identity first: unchanged inputs cost nothing.
    if known is None or known[0] != inputs:
        known = table[key] = (inputs, derive())
    return known[1]


_Keyed = tuple[ObjKey, Mapping[str, Any]]


def _oldest_first(keyed: Sequence[_Keyed], memo: PlanMemo) -> list[_Keyed]:
    epoch = datetime.min.replace(tzinfo=UTC)

    def sort_key(item: tuple[int, _Keyed]) -> tuple[bool, datetime, int]:
        position, (key, body) = item
        created = memo.created(key, body)
        return (created is None, created or epoch, position)

    return [item for _, item in sorted(enumerate(keyed), key=sort_key)]


def _not_in_pool(key: ObjKey, tenant_id: str | None, tier: Tier | None, want: Want) -> TenantPlan:
    return TenantPlan(key=key, tenant_id=tenant_id, tier=tier, accepted=want)


def plan_missing_pool(
    namespace: str, name: str, tenants: Sequence[Mapping[str, Any]]
) -> PoolPlan:
    plans = {}
    for body in tenants:
        key = _key(body)
        want = Want(ConditionType.ACCEPTED, "False", ConditionReason.POOL_NOT_FOUND,
            f"InferencePool {namespace}/{name} does not exist (spec.poolRef.name); "
            "the quota takes effect once it is created",
        )
        plans[key] = _not_in_pool(key, None, None, want)
    return PoolPlan(namespace=namespace, name=name, exists=False, tenants=plans)


def _parse_quotas(
    ordered: Sequence[_Keyed], pool_ref: str, memo: PlanMemo
) -> tuple[list[_Quota], dict[ObjKey, TenantPlan]]:
    """Valid quotas (oldest first, one per tenant id) and plans for the refused ones."""
    quotas: list[_Quota] = []
    refused: dict[ObjKey, TenantPlan] = {}
    owners: dict[str, ObjKey] = {}
    for key, body in ordered:
        try:
            spec = memo.quota_spec(key, body.get("spec") or {})
        except ValidationError as error:
            want = Want(ConditionType.ACCEPTED, "False", ConditionReason.INVALID_SPEC,
                        describe_errors(error))
            refused[key] = _not_in_pool(key, None, None, want)
            continue
        tenant_id = spec.tenant_id or key[1]
        owner = owners.get(tenant_id)
        if owner is not None:
            want = Want(ConditionType.ACCEPTED, "False", ConditionReason.DUPLICATE_TENANT,
                f"tenantId {tenant_id!r} is already used by the older TenantQuota "
                f"{owner[0]}/{owner[1]} in pool {pool_ref}",
            )
            refused[key] = _not_in_pool(key, tenant_id, spec.tier, want)
            continue
        owners[tenant_id] = key
        quotas.append(_Quota(key, tenant_id, spec))
    return quotas, refused


def _unreachable(entry: TenantPolicy, per_engine: int | None, watermark: float) -> str | None:
    """Why the tenant's per-engine maxBlocks can never be reached on an engine of the
    pool, or None: beyond its guarantee a request can take only the blocks above the
    engine's watermark (the sidecar refuses a larger one at once with 400
    REQUEST_EXCEEDS_ENGINE_CAPACITY). A pool-wide guarantee may borrow the watermark's
    room too, so only the engine's size binds it (MaxBlocksAboveCapacity's concern)."""
    if per_engine is None or (entry.pool_wide is not None and entry.pool_wide.guaranteed_blocks):
        return None
    room = per_engine - watermark_floor(watermark, per_engine)
    reach = max(entry.guaranteed_blocks, room)
    if entry.max_blocks_per_engine <= reach:
        return None
    return (f"maxBlocks is {entry.max_blocks_per_engine} blocks per engine, but an engine "
            f"of {per_engine} blocks gives this tenant at most {reach}: beyond its "
            f"{entry.guaranteed_blocks} guaranteed blocks per engine a request can use only "
            f"the {room} blocks above the watermark ({watermark:g}), and a larger request "
            "is refused (400 REQUEST_EXCEEDS_ENGINE_CAPACITY); lower maxBlocks, raise "
            "guaranteedBlocks or add engines")


def _admission_want(
    quota: _Quota, accepted: bool, budget: int | None, granted_before: int,
    waiting_behind: ObjKey | None, pool_ref: str, capacity: int | None, watermark: float,
    unreachable: str | None = None,
) -> Want:
    blocks = quota.spec.kv_cache.guaranteed_blocks
    if budget is None:
        return Want(ConditionType.ACCEPTED, "Unknown", ConditionReason.CAPACITY_UNKNOWN,
            f"pool {pool_ref} has no known KV capacity yet (set spec.kvCache.capacityBlocks "
            f"or wait for ready engines); guaranteedBlocks {blocks} applied provisionally",
        )
    if accepted:
        text = (f"guaranteedBlocks {blocks} reserved in pool {pool_ref}" if blocks
                else "no guaranteed blocks requested (borrowing only)")
        ceiling = quota.spec.kv_cache.max_blocks
        if capacity is not None and ceiling > capacity:
            return Want(
                ConditionType.ACCEPTED, "True", ConditionReason.MAX_BLOCKS_ABOVE_CAPACITY,
                f"{text}; maxBlocks {ceiling} is above the pool's capacity of {capacity} "
                "blocks, so the capacity, not maxBlocks, is the tenant's limit",
            )
        if unreachable is not None:
            return Want(ConditionType.ACCEPTED, "True", ConditionReason.MAX_BLOCKS_UNREACHABLE,
                        f"{text}; {unreachable}")
        return Want(ConditionType.ACCEPTED, "True", ConditionReason.ACCEPTED, text)
    if waiting_behind is not None:
        detail = (f"it waits behind the older TenantQuota {waiting_behind[0]}/"
                  f"{waiting_behind[1]}, which does not fit either")
    else:
        detail = f"{granted_before} blocks are already guaranteed to older quotas"
    return Want(ConditionType.ACCEPTED, "False", ConditionReason.OVERSUBSCRIBED,
        f"guaranteedBlocks {blocks} does not fit: pool {pool_ref} can guarantee {budget} "
        f"blocks ({capacity} x (1 - watermark {watermark:g})) and {detail}; running "
        "with guaranteedBlocks 0 (borrowing only) until capacity frees up",
    )


def plan_pool(
    pool: Mapping[str, Any] | None,
    tenants: Sequence[Mapping[str, Any]],
    *,
    namespace: str,
    name: str,
    ready_replicas: int,
    reported_capacities: Sequence[int] = (),
    memo: PlanMemo | None = None,
    pool_spec: InferencePoolSpec | ValidationError | None = None,
    engine_splits: Splits | None = None,
) -> PoolPlan:
    """Decide every quota of one pool. `tenants` come in tie-break order (file order in
    local mode, name order in the cluster); creationTimestamp sorts first. A `memo`
    kept between calls for the same pool makes re-planning cost what changed.
    `pool_spec`: the pool's spec as the caller parsed it (`PlanMemo.parse_pool`), so
    one reconcile parses it once; parsed from `pool` when absent.
    `engine_splits` (the demand-driven split, `split.demand.PoolSplit.splits`) become
    the policy's per-engine overrides where they still fit the quotas."""
    memo = memo if memo is not None else PlanMemo()
    keyed = [(_key(body), body) for body in tenants]
    memo.keep_only({key for key, _ in keyed})
    ordered = _oldest_first(keyed, memo)
    bodies = [body for _, body in ordered]
    if pool is None:
        return plan_missing_pool(namespace, name, bodies)
    pool_ref = f"{namespace}/{name}"
    spec = pool_spec if pool_spec is not None else memo.parse_pool(pool)
    if isinstance(spec, ValidationError):
        return _plan_invalid_pool(namespace, name, bodies, describe_errors(spec))

    replicas = max(ready_replicas, 1)
    per_engine = engine_capacity(spec.kv_cache.capacity_blocks, reported_capacities)
    capacity = per_engine * replicas if per_engine else None
    budget = (
        guaranteeable_blocks(per_engine, replicas, spec.kv_cache.watermark)
        if per_engine else None
    )
    watermark = spec.kv_cache.watermark
    quotas, plans = _parse_quotas(ordered, pool_ref, memo)
    decisions = admit_oldest_first(
        [(q.key, q.spec.kv_cache.guaranteed_blocks) for q in quotas],
        budget if budget is not None else 2**62,
    )
    granted_total = 0
    rendered: list[RenderedTenant] = []
    for quota in quotas:
        decision = decisions[quota.key]
        granted = quota.spec.kv_cache.guaranteed_blocks if decision.accepted else 0
        granted_total += granted
        derived = memo.entry(
            quota.key, (spec, quota.spec, quota.tenant_id, replicas, granted),
            functools.partial(_derive, spec, quota, replicas, granted),
        )
        # Everything `_admission_want` reads (what an older quota's edit changes of a
        # refused one's message), so an unchanged quota keeps its TenantPlan object.
        admission = (decision.accepted, budget, capacity, per_engine, watermark, pool_ref) + (
            () if decision.accepted else (decision.granted_before, decision.waiting_behind))
        plans[quota.key] = memo.tenant_plan(
            quota.key, (derived, quota.spec, quota.tenant_id, *admission),
            functools.partial(_tenant_plan, quota, derived, decision, budget, pool_ref,
                              capacity, watermark, per_engine),
        )
        if not isinstance(derived, ValidationError):
            rendered.append(derived[1])
    overrides = engine_overrides({t.policy.tenant_id: t.policy for t in rendered},
                                 engine_splits or {}, replicas)
    try:
        policy = compose_policy(namespace, name, spec, rendered, replicas=replicas,
                                engines=overrides)
    except ValidationError as error:
        return _plan_invalid_pool(namespace, name, bodies, describe_errors(error, "policy"))
    return PoolPlan(
        namespace=namespace, name=name, exists=True, replicas=replicas,
        capacity_per_engine=per_engine, budget=budget,
        requested_blocks=sum(q.spec.kv_cache.guaranteed_blocks for q in quotas),
        guaranteed_blocks=granted_total, watermark=watermark,
        rendered=policy, tenants=plans, demand_split=spec.quota_split is QuotaSplit.DEMAND,
    )


def _tenant_plan(
    quota: _Quota, derived: _Entry, decision: Admission, budget: int | None, pool_ref: str,
    capacity: int | None, watermark: float, per_engine: int | None = None,
) -> TenantPlan:
    if isinstance(derived, ValidationError):
        want = Want(ConditionType.ACCEPTED, "False", ConditionReason.INVALID_SPEC,
                    describe_errors(derived, "tenant"))
        return _not_in_pool(quota.key, quota.tenant_id, quota.spec.tier, want)
    resolved, entry = derived
    want = _admission_want(
        quota, decision.accepted, budget, decision.granted_before,
        cast("ObjKey | None", decision.waiting_behind), pool_ref, capacity, watermark,
        _unreachable(entry.policy, per_engine, watermark),
    )
    return TenantPlan(
        key=quota.key, tenant_id=quota.tenant_id, tier=quota.spec.tier, accepted=want,
        resolved=resolved, policy=entry.policy, digest=entry.digest,
    )


def _derive(pool: InferencePoolSpec, quota: _Quota, replicas: int, granted: int) -> _Entry:
    """One quota's resolved settings and policy entry, or why the entry is invalid."""
    resolved = resolve_tenant(
        pool, quota.spec, tenant_id=quota.tenant_id, replicas=replicas,
        guaranteed_blocks=granted,
    )
    try:
        entry = tenant_policy(resolved, pool_wide=pool.pool_store is not None)
    except ValidationError as error:
        return error
    return resolved, render_tenant(entry)


def _plan_invalid_pool(
    namespace: str, name: str, tenants: Sequence[Mapping[str, Any]], error: str
) -> PoolPlan:
    want = Want(ConditionType.ACCEPTED, "Unknown", ConditionReason.POOL_INVALID,
        f"InferencePool {namespace}/{name} is invalid: {error}",
    )
    plans = {_key(b): _not_in_pool(_key(b), None, None, want) for b in tenants}
    return PoolPlan(namespace=namespace, name=name, exists=True, error=error, tenants=plans)
