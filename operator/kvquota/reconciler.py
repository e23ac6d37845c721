"""Reconcile one InferencePool and every TenantQuota that references it.

Level-triggered: whatever changed (a pool, a quota, a deletion, an engine poll), the
pool is recomputed from kopf's indices (the latest state of every object) and what the
engines last reported, then only differences are written: the ConfigMap when the
policy hash changed, each status when a field changed. Requests for the same pool are
coalesced, so a burst of quota edits costs a couple of renders, not one per edit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from engine_sidecar.policy import EnginePolicy
from kvquota.api import InferencePoolSpec, LabelSelector
from kvquota.conditions import Want
from kvquota.engines import gateway_selector
from kvquota.plan import PoolPlan, plan_pool
from kvquota.render import HASH_ANNOTATION, POLICY_KEY, build_configmap, configmap_name
from kvquota.status import (
    POOL_FIELDS,
    TENANT_FIELDS,
    EngineView,
    event_worthy,
    pool_status,
    status_patch,
    tenant_status,
)
from kvquota.sync import PolicyHistory
from kvquota.usage import DisruptionWindow, EngineObservation, aggregate

if TYPE_CHECKING:
    from kvquota.engines import EnginePoller
    from kvquota.kube import KubeApi
    from kvquota.runtime import OperatorConfig

logger = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # (namespace, pool name)
POOLS, TENANTS = "inferencepools", "tenantquotas"


class Coalescer:
    """Runs `fn(key)` at most once at a time per key. A caller returns after a run that
    started after its request; requests that arrive during a run share the next one."""

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
        async with slot.lock:
            if slot.done >= ticket:
                return
            target = slot.requested
            await self._fn(key)
            slot.done = target


def _post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event through kopf's poster (outside kopf, e.g. in unit use: no-op)."""
    import kopf

    try:
        target = kopf.Body(cast("kopf.RawBody", dict(body)))
        kopf.event(target, type=type_, reason=reason, message=message[:1024])
    except LookupError:
        logger.debug("no kopf context to post %s/%s", type_, reason)


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = body.get("metadata") or {}
    return meta


class PoolReconciler:
    def __init__(self, kube: KubeApi, poller: EnginePoller, config: OperatorConfig) -> None:
        self._kube = kube
        self._poller = poller
        self._config = config
        self._coalescer = Coalescer(self._reconcile)
        self._pools: Mapping[PoolKey, Iterable[Mapping[str, Any]]] = {}
        self._tenants: Mapping[PoolKey, Iterable[Mapping[str, Any]]] = {}
        self._observations: dict[PoolKey, EngineObservation] = {}
        self._problems: dict[PoolKey, Want | None] = {}
        self._polled_at: dict[PoolKey, float] = {}
        self._histories: dict[PoolKey, PolicyHistory] = {}
        self._windows: dict[PoolKey, DisruptionWindow] = {}
        # Policy hash the pool's ConfigMap holds, as far as we know; checked against the
        # API on every engine poll (someone may edit or delete the ConfigMap).
        self._configmaps: dict[PoolKey, str] = {}
        self._verify: set[PoolKey] = set()
        # What we last wrote per object, until the watch shows it (keyed by resourceVersion).
        self._written: dict[tuple[str, str, str], tuple[str | None, dict[str, Any]]] = {}
        self.reconciles = 0

    def bind(
        self,
        pools: Mapping[PoolKey, Iterable[Mapping[str, Any]]],
        tenants: Mapping[PoolKey, Iterable[Mapping[str, Any]]],
    ) -> None:
        """Attach kopf's live indices (pools by key, quotas by pool key)."""
        self._pools, self._tenants = pools, tenants

    # ------------------------------------------------------------ entry points

    async def reconcile(self, key: PoolKey) -> None:
        await self._coalescer.run(key)

    async def poll_if_due(self, key: PoolKey) -> None:
        """Timer tick: poll when the poll interval has passed."""
        if time.monotonic() - self._polled_at.get(key, -1e9) >= self._config.poll_interval:
            await self.poll(key)

    async def poll(self, key: PoolKey) -> None:
        """Poll the pool's engines, then reconcile with what they said and check the
        ConfigMap against the API. Polling happens outside the coalesced run, so slow
        engines never delay a quota change."""
        pool = self._pool(key)
        if pool is None:
            return
        self._polled_at[key] = time.monotonic()
        await self._observe(key, pool)
        self._verify.add(key)
        await self.reconcile(key)

    def forget(self, plural: str, namespace: str, name: str) -> None:
        self._written.pop((plural, namespace, name), None)
        if plural == POOLS:
            key = (namespace, name)
            self._observations.pop(key, None)
            self._problems.pop(key, None)
            self._polled_at.pop(key, None)
            self._histories.pop(key, None)
            self._windows.pop(key, None)
            self._configmaps.pop(key, None)

    # ------------------------------------------------------------ engines

    def _pool(self, key: PoolKey) -> Mapping[str, Any] | None:
        return next(iter(self._pools.get(key, ())), None)

    async def _selector(self, namespace: str, spec: Mapping[str, Any]) -> LabelSelector | Want:
        try:
            pool_spec = InferencePoolSpec.model_validate(spec)
        except ValidationError:
            return Want("Ready", "False", "InvalidSpec", "the pool's spec is invalid")
        if pool_spec.selector is not None:
            return pool_spec.selector
        ref = pool_spec.gateway_pool_ref.name if pool_spec.gateway_pool_ref else ""
        gateway = await self._kube.get_gateway_pool(namespace, ref)
        if gateway is None:
            return Want("Ready", "False", "GatewayPoolNotFound",
                        f"Gateway API InferencePool {namespace}/{ref} not found "
                        "(spec.gatewayPoolRef)")
        selector = gateway_selector(gateway)
        if selector is None:
            return Want("Ready", "False", "GatewayPoolInvalid",
                        f"Gateway API InferencePool {namespace}/{ref} has no label selector")
        return selector

    async def _observe(self, key: PoolKey, pool: Mapping[str, Any]) -> EngineObservation:
        selector = await self._selector(key[0], pool.get("spec") or {})
        if isinstance(selector, Want):
            observation, problem = EngineObservation(observed_at=self._config.clock()), selector
        else:
            observation, problem = await self._poller.observe(key[0], selector), None
        window = self._windows.setdefault(key, DisruptionWindow(self._config.degraded_window))
        window.observe(observation.observed_at, observation.reports)
        self._observations[key], self._problems[key] = observation, problem
        return observation

    # ------------------------------------------------------------ the reconcile

    async def _reconcile(self, key: PoolKey) -> None:
        self.reconciles += 1
        namespace, name = key
        pool = self._pool(key)
        tenants = sorted(self._tenants.get(key, ()), key=lambda b: str(_meta(b).get("name")))
        if pool is None:
            plan = plan_pool(None, tenants, namespace=namespace, name=name, ready_replicas=0)
            await self._write_tenants(tenants, plan, None, key)
            return
        observation = self._observations.get(key)
        if observation is None:  # first sight since start: know the replicas before rendering
            observation = await self._observe(key, pool)
        plan = plan_pool(
            pool, tenants, namespace=namespace, name=name,
            ready_replicas=observation.replicas,
            reported_capacities=observation.reported_capacities(),
        )
        if plan.policy is not None:
            history = self._histories.setdefault(key, PolicyHistory())
            history.record(plan.policy, plan.digests)
            verify = key in self._verify
            self._verify.discard(key)
            try:
                await self._write_configmap(pool, plan.policy, history, verify=verify)
            except BaseException:
                self._configmaps.pop(key, None)  # unsure what was written: verify next time
                raise
        reports = observation.reports
        engines = EngineView(
            ready=observation.replicas,
            matched=observation.matched,
            versions={pod: (reports[pod].policy_version if pod in reports else None)
                      for pod in observation.ready},
            problem=self._problems.get(key),
            errors=observation.errors,
            usage=aggregate(reports.values()),
            window_seconds=self._config.degraded_window,
        )
        now = datetime.now(UTC)
        await self._write_status(
            POOLS, "InferencePool", pool, POOL_FIELDS,
            lambda old: pool_status(plan, engines=engines, old=old,
                                    generation=_meta(pool).get("generation"), now=now),
        )
        await self._write_tenants(tenants, plan, engines, key)

    async def _write_configmap(
        self, pool: Mapping[str, Any], policy: EnginePolicy, history: PolicyHistory,
        *, verify: bool,
    ) -> None:
        """Write the policy when its hash differs from what the ConfigMap holds. The hot
        path trusts what we last wrote (no read of a large object per quota edit);
        `verify` (engine polls) and the first sight of a pool read the ConfigMap."""
        meta = _meta(pool)
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        key, cm_name = (namespace, name), configmap_name(name)
        known = self._configmaps.get(key)
        if known == policy.version and not verify:
            return
        desired = build_configmap(namespace, name, meta.get("uid"), policy)
        patch = {
            "metadata": {k: desired["metadata"][k] for k in
                         ("labels", "annotations", "ownerReferences")
                         if k in desired["metadata"]},
            "data": desired["data"],
        }
        if verify or known is None:
            current = await self._kube.get_configmap(namespace, cm_name)
            if current is None:
                await self._kube.create_configmap(desired)
            else:
                self._remember_running(history, current)
                if self._holds(current, desired):
                    self._configmaps[key] = policy.version
                    return
                await self._kube.patch_configmap(namespace, cm_name, patch)
        elif not await self._kube.patch_configmap(namespace, cm_name, patch):
            await self._kube.create_configmap(desired)  # deleted since we last wrote it
        self._configmaps[key] = policy.version
        logger.info("pool %s/%s: policy %s written to ConfigMap %s (%d tenants)",
                    namespace, name, policy.version, cm_name, len(policy.tenants))
        _post_event(pool, "Normal", "PolicyUpdated",
                    f"policy {policy.version} ({len(policy.tenants)} tenants, split over "
                    f"{policy.replicas} replicas) written to ConfigMap {cm_name}")

    @staticmethod
    def _holds(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
        """The ConfigMap already carries exactly the desired policy and owner."""
        meta = current.get("metadata") or {}
        return bool(
            (meta.get("annotations") or {}).get(HASH_ANNOTATION)
            == desired["metadata"]["annotations"][HASH_ANNOTATION]
            and (current.get("data") or {}).get(POLICY_KEY) == desired["data"][POLICY_KEY]
            and meta.get("ownerReferences") == desired["metadata"].get("ownerReferences")
        )

    @staticmethod
    def _remember_running(history: PolicyHistory, current: Mapping[str, Any]) -> None:
        """After a restart, engines still run the ConfigMap's previous policy: learn
        which tenant settings it carries, so unchanged tenants stay Ready."""
        version = ((current.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
        if not version or history.carries_version(version):
            return
        try:
            history.record(EnginePolicy.from_json((current.get("data") or {}).get(POLICY_KEY, "")))
        except ValueError:
            logger.warning("ConfigMap of pool %s holds an unreadable policy", version)

    async def _write_tenants(
        self, tenants: list[Mapping[str, Any]], plan: PoolPlan,
        engines: EngineView | None, key: PoolKey,
    ) -> None:
        history = self._histories.get(key)
        window = self._windows.get(key)
        now, clock = datetime.now(UTC), self._config.clock()
        limit = asyncio.Semaphore(self._config.status_concurrency)

        async def write(body: Mapping[str, Any]) -> None:
            meta = _meta(body)
            tenant = (plan.tenants or {}).get((str(meta.get("namespace")), str(meta.get("name"))))
            if tenant is None:
                return
            disruptions = (window.disruptions(tenant.tenant_id, clock)
                           if window is not None and tenant.tenant_id else None)
            async with limit:
                await self._write_status(
                    TENANTS, "TenantQuota", body, TENANT_FIELDS,
                    lambda old: tenant_status(
                        tenant, plan, engines=engines if plan.exists else None,
                        history=history, disruptions=disruptions, old=old,
                        generation=meta.get("generation"), now=now,
                    ),
                )

        await asyncio.gather(*(write(body) for body in tenants))

    async def _write_status(
        self, plural: str, kind: str, body: Mapping[str, Any], owned: tuple[str, ...],
        build: Callable[[Mapping[str, Any]], dict[str, Any]],
    ) -> None:
        meta = _meta(body)
        ident = (plural, str(meta.get("namespace")), str(meta.get("name")))
        version = meta.get("resourceVersion")
        remembered = self._written.get(ident)
        old: Mapping[str, Any] = body.get("status") or {}
        if remembered is not None:
            if remembered[0] == version:
                old = remembered[1]  # our last write is not in the watch yet
            else:
                del self._written[ident]
        new = build(old)
        patch = status_patch(old, new, owned)
        if patch is None:
            return
        if not await self._kube.patch_status(plural, ident[1], ident[2], patch):
            return  # deleted meanwhile
        merged = {k: v for k, v in {**old, **patch}.items() if v is not None}
        self._written[ident] = (version, merged)
        for type_, reason, message in event_worthy(kind, old, new):
            _post_event(body, type_, reason, message)
