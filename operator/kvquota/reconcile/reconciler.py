"""Reconcile one InferencePool and every TenantQuota that references it.

Level-triggered: whatever changed (a pool, a quota, a deletion, an engine poll), the
pool is recomputed from kopf's indices (the latest state of every object) and what the
engines last reported, then only differences are written: the ConfigMap when the
policy hash changed, each status when a field changed.

A reconcile has two stages, each coalesced per pool (requests that arrive during a
run share the next one): the policy (plan, then the ConfigMap) and the status writes.
They run apart, so a burst of new quotas does not hold the next policy behind the
hundreds of status patches of the previous one, and a plan reuses what it derived for
unchanged quotas (`PlanMemo`): re-planning after one edit costs that edit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvquota import metrics
from kvquota.api import ConditionReason, ConditionType, InferencePoolSpec, LabelSelector
from kvquota.policy.conditions import Want
from kvquota.policy.plan import ObjKey, PlanMemo, PoolPlan, TenantPlan, plan_pool
from kvquota.reconcile.engines import gateway_selector
from kvquota.reconcile.publish import publish_policy
from kvquota.reconcile.status import (
    POOL_FIELDS,
    TENANT_FIELDS,
    EngineView,
    engine_split,
    pool_status,
    tenant_status,
)
from kvquota.reconcile.status_writer import PendingStatus, StatusWriter
from kvquota.reconcile.sync import PolicyHistory
from kvquota.reconcile.usage import Disruptions, DisruptionWindow, EngineObservation, aggregate
from kvquota.split.demand import PoolSplit, moved_tenants_split

if TYPE_CHECKING:
    from kvquota.reconcile.engines import EnginePoller
    from kvquota.reconcile.kube import KubeApi
    from kvquota.runtime import OperatorConfig

logger = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # (namespace, pool name)
POOLS, TENANTS = "inferencepools", "tenantquotas"


class Coalescer:
    """Runs `fn(key)` at most once at a time per key. A caller returns after a run that
    started after its request; requests that arrive during a run share the next one.
    A key nobody waits for keeps no slot."""

    @dataclass
    class _Slot:
        lock: asyncio.Lock
        requested: int = 0
        done: int = 0

    def __init__(self, fn: Callable[[PoolKey], Awaitable[None]]) -> None:
        self._fn = fn
        self._slots: dict[PoolKey, Coalescer._Slot] = {}

    async def run(self, key: PoolKey) -> None:
        slot = self._slots.setdefault(key, Coalescer._Slot(asyncio.Lock()))
        slot.requested += 1
        ticket = slot.requested
        try:
            async with slot.lock:
                if slot.done >= ticket:
                    return
                target = slot.requested
                await self._fn(key)
                slot.done = target
        finally:
            # Every request served: a waiter still holding the slot only returns.
            if slot.done >= slot.requested and self._slots.get(key) is slot:
                del self._slots[key]


@dataclass(frozen=True)
class _Planned:
    """The latest plan of a pool and what its status writes need from plan time."""

    plan: PoolPlan
    engines: EngineView | None  # None: the pool does not exist
    pool_generation: Any
    generations: Mapping[ObjKey, Any]  # tenant -> the generation the plan saw


@dataclass
class _PoolState:
    """What the reconciler keeps about one pool between reconciles, in one place so a
    deleted pool is forgotten in one step."""

    memo: PlanMemo = field(default_factory=PlanMemo)
    planned: _Planned | None = None  # the latest plan, for the status stage
    observation: EngineObservation | None = None  # the engines' latest poll
    problem: Want | None = None  # why the engines could not be found at that poll
    polled_at: float = -1e9  # time.monotonic() of that poll
    window: DisruptionWindow | None = None  # disruptions of recent polls
    history: PolicyHistory = field(default_factory=PolicyHistory)  # of the policies rendered
    split: PoolSplit | None = None  # the demand-driven split (spec.quotaSplit: Demand)
    # Policy hash the pool's ConfigMap holds, as far as we know; checked against the
    # API after every engine poll (`verify`: someone may edit or delete the ConfigMap).
    configmap: str | None = None
    verify: bool = False


def _tenant_inputs(
    tenant: TenantPlan, plan: PoolPlan, engines: EngineView | None,
    history: PolicyHistory | None, disruptions: Disruptions | None, generation: Any,
) -> tuple[Any, ...]:
    """What `tenant_status` reads of its arguments, as a comparable tuple."""
    observed: tuple[Any, ...] = ()
    if engines is not None and plan.exists:
        applied = (history.applied_on(engines.versions.values(), tenant.tenant_id,
                                      tenant.digest)
                   if history is not None and tenant.tenant_id and tenant.digest else None)
        seen = engines.usage.tenants.get(tenant.tenant_id) if tenant.tenant_id else None
        observed = (engines.ready, engines.window_seconds, applied, seen,
                    tuple(engine_split(tenant, plan, engines)))
    return (tenant, plan.exists, plan.error, plan.ref, engines is None, observed,
            disruptions, generation)


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = body.get("metadata") or {}
    return meta


def _key(body: Mapping[str, Any]) -> ObjKey:
    meta = _meta(body)
    return (str(meta.get("namespace")), str(meta.get("name")))


class PoolReconciler:
    """Reconciles pools from kopf's indices (`bind`): `reconcile` after a change,
    `poll` for the engines' reports; `forget` drops a deleted object's state."""

    def __init__(self, kube: KubeApi, poller: EnginePoller, config: OperatorConfig) -> None:
        self._kube = kube
        self._poller = poller
        self._config = config
        self._policy_runs = Coalescer(self._plan_and_publish)
        self._status_runs = Coalescer(self._publish_status)
        self._pools: Mapping[PoolKey, Iterable[Mapping[str, Any]]] = {}
        self._tenants: Mapping[PoolKey, Iterable[Mapping[str, Any]]] = {}
        self._states: dict[PoolKey, _PoolState] = {}
        self._statuses = StatusWriter(kube)
        self.reconciles = 0

    def bind(
        self,
        pools: Mapping[PoolKey, Iterable[Mapping[str, Any]]],
        tenants: Mapping[PoolKey, Iterable[Mapping[str, Any]]],
    ) -> None:
        """Attach kopf's live indices (pools by key, quotas by pool key)."""
        self._pools, self._tenants = pools, tenants

    # ------------------------------------------------------------ entry points

    async def reconcile(self, key: PoolKey, since: float | None = None) -> None:
        """Bring the pool's ConfigMap, then every status, up to date with what is known
        now. `since` (time.monotonic) is when the change was seen, for the latency."""
        await self._policy_runs.run(key)
        if since is not None:
            metrics.CHANGE_TO_CONFIGMAP.observe(time.monotonic() - since)
        await self._status_runs.run(key)

    def poll_due(self, key: PoolKey) -> bool:
        """Timer tick: whether the poll interval has passed since the last poll."""
        state = self._states.get(key)
        polled_at = state.polled_at if state is not None else -1e9
        return time.monotonic() - polled_at >= self._config.poll_interval

    async def poll(self, key: PoolKey, since: float | None = None) -> None:
        """Poll the pool's engines, then reconcile with what they said and check the
        ConfigMap against the API. Polling happens outside the coalesced run, so slow
        engines never delay a quota change."""
        pool = self._pool(key)
        if pool is None:
            return
        state = self._state(key)
        state.polled_at = time.monotonic()
        observation = await self._observe(key, state, state.memo.parse_pool(pool))
        planned = state.planned
        if planned is not None and planned.plan.demand_split:  # one round per poll
            state.split = state.split or PoolSplit()
            state.split.poll_round(planned.plan.split_inputs, observation.ready,
                                   observation.reports)
        else:  # spec.quotaSplit: Even (the default), or back to it
            state.split = None
        state.verify = True
        await self.reconcile(key, since)

    def forget(self, plural: str, namespace: str, name: str) -> None:
        self._statuses.forget((plural, namespace, name))
        if plural == POOLS:
            self._states.pop((namespace, name), None)
            metrics.forget_pool(namespace, name)

    def _state(self, key: PoolKey) -> _PoolState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _PoolState()
        return state

    # ------------------------------------------------------------ engines

    def _pool(self, key: PoolKey) -> Mapping[str, Any] | None:
        return next(iter(self._pools.get(key, ())), None)

    async def _selector(self, namespace: str, pool_spec: InferencePoolSpec | ValidationError,
                        ) -> LabelSelector | Want:
        if isinstance(pool_spec, ValidationError):
            return Want(ConditionType.READY, "False", ConditionReason.INVALID_SPEC,
                        "the pool's spec is invalid")
        if pool_spec.selector is not None:
            return pool_spec.selector
        ref = pool_spec.gateway_pool_ref.name if pool_spec.gateway_pool_ref else ""
        gateway = await self._kube.get_gateway_pool(namespace, ref)
        if gateway is None:
            return Want(ConditionType.READY, "False", ConditionReason.GATEWAY_POOL_NOT_FOUND,
                        f"Gateway API InferencePool {namespace}/{ref} not found "
                        "(spec.gatewayPoolRef)")
        selector = gateway_selector(gateway)
        if selector is None:
            return Want(ConditionType.READY, "False", ConditionReason.GATEWAY_POOL_INVALID,
                        f"Gateway API InferencePool {namespace}/{ref} has no label selector")
        return selector

    async def _observe(self, key: PoolKey, state: _PoolState,
                       pool_spec: InferencePoolSpec | ValidationError) -> EngineObservation:
        selector = await self._selector(key[0], pool_spec)
        if isinstance(selector, Want):
            observation, problem = EngineObservation(observed_at=self._config.clock()), selector
        else:
            observation, problem = await self._poller.observe(key[0], selector), None
        if state.window is None:
            state.window = DisruptionWindow(self._config.degraded_window)
        state.window.observe(observation.observed_at, observation.reports)
        state.observation, state.problem = observation, problem
        return observation

    # ------------------------------------------------------------ the reconcile

    async def _plan_and_publish(self, key: PoolKey) -> None:
        """Stage one: plan the pool and write its ConfigMap if the policy changed."""
        self.reconciles += 1
        namespace, name = key
        pool = self._pool(key)
        tenants = sorted(self._tenants.get(key, ()), key=lambda b: str(_meta(b).get("name")))
        generations = {_key(b): _meta(b).get("generation") for b in tenants}
        if pool is None and not tenants:  # deleted, and no quota names it: keep nothing
            self._states.pop(key, None)
            return
        state = self._state(key)
        if pool is None:
            plan = plan_pool(None, tenants, namespace=namespace, name=name, ready_replicas=0,
                             memo=state.memo)
            state.planned = _Planned(plan, None, None, generations)
            return
        pool_spec = state.memo.parse_pool(pool)  # once per reconcile (and per change)
        observation = state.observation
        if observation is None:  # first sight since start: know the replicas before rendering
            observation = await self._observe(key, state, pool_spec)
        plan = plan_pool(
            pool, tenants, namespace=namespace, name=name,
            ready_replicas=observation.replicas,
            reported_capacities=observation.reported_capacities(),
            memo=state.memo, pool_spec=pool_spec,
            engine_splits=state.split.splits if state.split is not None else None,
        )
        metrics.set_refused(namespace, name, Counter(
            t.accepted.reason for t in (plan.tenants or {}).values()
            if t.accepted.status == "False"))
        if plan.rendered is not None:
            state.history.record(plan.rendered.policy, plan.digests)
            verify, state.verify = state.verify, False
            try:
                state.configmap = await publish_policy(
                    self._kube, pool, plan.rendered, known=state.configmap,
                    history=state.history, verify=verify)
            except BaseException:
                state.configmap = None  # unsure what was written: verify next time
                raise
        reports = observation.reports
        engines = EngineView(
            ready=observation.replicas,
            matched=observation.matched,
            versions={pod: (reports[pod].policy_version if pod in reports else None)
                      for pod in observation.ready},
            problem=state.problem,
            errors=observation.errors,
            usage=aggregate(reports.values()),
            window_seconds=self._config.degraded_window,
            store_reachable={pod: reports[pod].pool_store_reachable is True
                             for pod in observation.ready
                             if pod in reports and reports[pod].pool_store_reachable is not None},
            store_problems={pod: problem for pod in observation.ready if pod in reports
                            and (problem := reports[pod].pool_store_problem) is not None},
        )
        version = plan.policy.version if plan.policy is not None else None
        metrics.set_engines(namespace, name, observed=engines.ready,
                            stale=engines.ready - engines.synced(version))
        metrics.set_engine_split(namespace, name, moved_tenants_split(
            plan.policy, observation.ready) if plan.policy is not None else {})
        state.planned = _Planned(plan, engines, _meta(pool).get("generation"), generations)

    async def _publish_status(self, key: PoolKey) -> None:
        """Stage two: the statuses of the pool and its quotas, from the latest plan.
        Bodies come from the index now (their latest status and resourceVersion);
        observedGeneration is what the plan saw, so a quota edited since is not
        claimed as observed until the next plan covers it."""
        state = self._states.get(key)
        planned = state.planned if state is not None else None
        if state is None or planned is None:
            return
        plan, engines = planned.plan, planned.engines
        tenants = [b for b in self._tenants.get(key, ()) if _key(b) in planned.generations]
        if engines is None:
            await self._write_tenants(tenants, planned, state)
            return
        pool = self._pool(key)
        if pool is not None:
            now = datetime.now(UTC)
            await self._statuses.write(
                POOLS, "InferencePool", pool, POOL_FIELDS,
                functools.partial(pool_status, plan, engines=engines,
                                  generation=planned.pool_generation, now=now),
            )
        await self._write_tenants(tenants, planned, state)

    async def _write_tenants(
        self, tenants: list[Mapping[str, Any]], planned: _Planned, state: _PoolState,
    ) -> None:
        plan, engines = planned.plan, planned.engines
        history, window = state.history, state.window
        now, clock = datetime.now(UTC), self._config.clock()
        pending: list[PendingStatus] = []
        for body in tenants:
            tenant = (plan.tenants or {}).get(_key(body))
            if tenant is None:
                continue
            disruptions = (window.disruptions(tenant.tenant_id, clock)
                           if window is not None and tenant.tenant_id else None)
            generation = planned.generations.get(tenant.key)
            write = self._statuses.prepare(
                TENANTS, "TenantQuota", body, TENANT_FIELDS,
                functools.partial(
                    tenant_status, tenant, plan, engines=engines if plan.exists else None,
                    history=history, disruptions=disruptions, generation=generation, now=now,
                ),
                _tenant_inputs(tenant, plan, engines, history, disruptions, generation),
            )
            if write is not None:
                pending.append(write)
        # Only the statuses that change become tasks (an edit: one, not 1,000).
        await self._statuses.send_all(pending, self._config.status_concurrency)
