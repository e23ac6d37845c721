"""The victim order: which running request or lease gives blocks back first.

A total order over the candidates, under one policy and one picture of each tenant's
usage: band (unclassified, above maxBlocks, borrowers, within guarantee), then tier,
then leases before running work and the least work lost. The order, and how admission
reads it the other way, is documented in docs/scheduler-plugin.md.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.contract.reclaim import Band, quota_band
from engine_sidecar.plugin.rules.leases import Lease


class Reason(StrEnum):
    """Why blocks were taken from a tenant (`preemptions` keys in the stats)."""

    UNCLASSIFIED = "unclassified"  # a running request without a known tenant
    BORROWER = "borrower"  # a running request of a tenant above its guarantee
    ABOVE_MAX = "above_max"  # a running request of a tenant above its maxBlocks
    TIER = "tier"  # a running request within its guarantee (lower tier, or least work)
    LEASE_BREAK = "lease_break"  # a live lease released under memory pressure
    DEGRADED = "degraded"  # a live lease released because nothing else could progress


_RUNNING_REASON = {
    Band.UNCLASSIFIED: Reason.UNCLASSIFIED,
    Band.ABOVE_MAX: Reason.ABOVE_MAX,
    Band.BORROWER: Reason.BORROWER,
    Band.GUARANTEED: Reason.TIER,
}


RankKey = tuple[float, ...]


class VictimRanker:
    """Ranks eviction candidates under one policy and one usage picture.

    `usage` maps tenant -> blocks in use (running + pinned). It is taken once when
    memory first runs out in a step and then debited as candidates are released,
    so the ranking stays consistent within the step without rescanning vLLM.
    """

    def __init__(self, policy: EnginePolicy | None, usage: dict[str, int]) -> None:
        self.policy = policy
        self.usage = usage
        self._classes: dict[str, tuple[Band, int]] = {}  # tenant -> (band, tier priority)

    def tenant_class(self, tenant: str) -> tuple[Band, int] | None:
        """(band, tier priority) of a tenant the policy knows, else None."""
        cls = self._classes.get(tenant)
        if cls is None:
            tenant_policy = self.tenant_policy(tenant)
            if tenant_policy is None:
                return None
            cls = self._classes[tenant] = (self.band(tenant_policy), tenant_policy.priority)
        return cls

    def tenant_policy(self, tenant: str | None) -> TenantPolicy | None:
        if tenant is None or self.policy is None:
            return None
        return self.policy.tenants.get(tenant)

    def band(self, tenant_policy: TenantPolicy) -> Band:
        # The policy the plugin holds is this engine's split: its guarantee is per engine.
        return quota_band(self.usage.get(tenant_policy.tenant_id, 0),
                          tenant_policy.guaranteed_blocks)

    def running_key(
        self,
        tenant: str | None,
        priority: int,
        num_computed_tokens: int,
        arrival_time: float,
        above_max: bool = False,
    ) -> RankKey:
        # Called for every running request when memory runs out: the class cache is
        # read inline, tenant_class() only fills it.
        cls = self._classes.get(tenant) if tenant is not None else None
        if cls is None and tenant is not None:
            cls = self.tenant_class(tenant)
        if cls is None:
            # vLLM's own priority-policy victim order.
            return (Band.UNCLASSIFIED, priority, 0, 0, arrival_time)
        band = cls[0]
        if above_max and self._reclaimable_beyond_max(tenant):
            band = Band.ABOVE_MAX
        return (band, cls[1], 0, -num_computed_tokens, arrival_time)

    def _reclaimable_beyond_max(self, tenant: str | None) -> bool:
        """Its tenant still lets its work run beyond maxBlocks (a policy change to Never
        makes it ordinary work again)."""
        tenant_policy = self.tenant_policy(tenant)
        return tenant_policy is not None and tenant_policy.ceiling is not None

    def lease_key(self, lease: Lease[Any]) -> RankKey:
        tenant_policy = self.tenant_policy(lease.tenant)
        if tenant_policy is None:  # the tenant left the policy; the lease is on its way out
            return (Band.UNCLASSIFIED, math.inf, 1, -lease.last_activity)
        return (self.band(tenant_policy), tenant_policy.priority, 1, -lease.last_activity)

    @staticmethod
    def running_reason(key: RankKey) -> Reason:
        return _RUNNING_REASON[Band(int(key[0]))]

    def debit(self, tenant: str | None, num_blocks: int) -> bool:
        """Take released blocks off a tenant's usage; True if it stopped borrowing."""
        if tenant is None or tenant not in self.usage:
            return False
        tenant_policy = self.tenant_policy(tenant)
        before = self.band(tenant_policy) if tenant_policy is not None else None
        self.usage[tenant] = max(0, self.usage[tenant] - num_blocks)
        if tenant_policy is None or self.band(tenant_policy) == before:
            return False
        self._classes.pop(tenant, None)
        return True
