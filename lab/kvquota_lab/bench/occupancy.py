"""How full the KV cache was while load arrived, and how long each tenant sat at a
ceiling its TenantQuota declares.

Two questions the suite must answer about a policy that reserves KV at admission:

- Does it leave the cache idle? `kv_share` is the time-weighted mean of blocks *in
  use* (referenced by a running request or a lease: vLLM's allocated blocks, not its
  evictable prefix cache) over the scenario's load window `[0, duration]`, as a share
  of capacity. The window is the same for every policy of a run (every session starts
  in it), so the shares of two policies compare the same demand.
- When a tier gets less than stock priority gives it, is that its own declared limit?
  A tenant is *at* `maxBlocks` while the blocks it **holds** (running requests and
  leases, as the plugin reports them) are at least `CEILING_SHARE` of it, and at
  `maxConcurrentRequests` while that many of its requests are in flight. Blocks
  reserved but not held do not count: a tenant whose reservations fill its quota while
  its requests hold half of it is limited by how admission reserves, not by its quota.

Both are step functions of virtual (or wall) time fed by the backend: `add_kv(start,
end, used)` for an interval during which `used` blocks were in use, `add_tenants(start,
end, held, inflight)` likewise per tenant. Only the part inside the load window counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvquota_lab.bench.scenario import Scenario, resolve_blocks

# Admission stops at maxBlocks counting what running requests may still grow into, so
# a tenant whose quota binds holds somewhat less than the quota: at most one request's
# growth below it. 90% is "at the ceiling" for the quotas of the shipped scenarios
# (hundreds to thousands of blocks, requests of tens).
CEILING_SHARE = 0.9
MAX_BLOCKS = "maxBlocks"
MAX_CONCURRENT = "maxConcurrentRequests"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    tier: str
    max_blocks: int
    max_concurrent: int | None  # None: no limit
    max_tokens: int = 0  # the ceiling admission clamps max_tokens to (0: unknown)


def declared_limits(scenario: Scenario) -> dict[str, TenantLimits]:
    """The ceilings each tenant's TenantQuota declares (quotas resolved to blocks; the
    maxTokens ceiling as the operator resolves it from the tier and the tenant)."""
    capacity = scenario.engine.capacity_blocks
    policy = scenario.engine_policy()
    return {
        tenant_id: TenantLimits(
            tenant.tier.value,
            resolve_blocks(tenant.kv_cache.max_blocks, capacity),
            tenant.limits.max_concurrent_requests,
            policy.tenants[tenant_id].max_tokens,
        )
        for tenant_id, tenant in scenario.tenants.items()
    }


@dataclass
class _TenantClock:
    at_max_blocks: float = 0.0
    at_max_concurrent: float = 0.0
    peak_held: int = 0
    held_block_seconds: float = 0.0


@dataclass
class Occupancy:
    window: float  # seconds: the load window [0, window]
    capacity: int
    limits: dict[str, TenantLimits]
    block_seconds: float = 0.0
    covered: float = 0.0  # seconds of the window an interval was reported for
    tenants_known: bool = False  # add_tenants was called (KVQuota: the plugin's stats)
    _tenants: dict[str, _TenantClock] = field(default_factory=dict)

    @classmethod
    def for_scenario(cls, scenario: Scenario) -> Occupancy:
        return cls(scenario.duration, scenario.engine.capacity_blocks,
                   declared_limits(scenario))

    def _clip(self, start: float, end: float) -> float:
        return max(0.0, min(end, self.window) - max(start, 0.0))

    def add_kv(self, start: float, end: float, used: int) -> None:
        seconds = self._clip(start, end)
        if seconds > 0:
            self.block_seconds += used * seconds
            self.covered += seconds

    def add_tenants(self, start: float, end: float, held: Mapping[str, int],
                    inflight: Mapping[str, int]) -> None:
        self.tenants_known = True
        seconds = self._clip(start, end)
        if seconds <= 0:
            return
        for tenant_id, limits in self.limits.items():
            clock = self._tenants.setdefault(tenant_id, _TenantClock())
            blocks = held.get(tenant_id, 0)
            clock.peak_held = max(clock.peak_held, blocks)
            clock.held_block_seconds += blocks * seconds
            if blocks >= CEILING_SHARE * limits.max_blocks:
                clock.at_max_blocks += seconds
            if limits.max_concurrent is not None and (
                inflight.get(tenant_id, 0) >= limits.max_concurrent
            ):
                clock.at_max_concurrent += seconds

    @property
    def kv_share(self) -> float | None:
        if self.covered <= 0 or self.capacity <= 0:
            return None
        return self.block_seconds / (self.covered * self.capacity)

    def to_json(self) -> dict[str, Any]:
        """`kvInUse` for the policy, `ceilings` per tenant (None: not measured)."""
        share = self.kv_share
        out: dict[str, Any] = {
            "kvInUse": None if share is None else round(share, 4),
            "loadWindowSeconds": self.window,
            "ceilings": None,
        }
        if self.tenants_known:
            span = self.covered or self.window
            ceilings = {}
            for tenant_id, limits in sorted(self.limits.items()):
                clock = self._tenants.get(tenant_id, _TenantClock())
                ceilings[tenant_id] = {
                    "tier": limits.tier,
                    MAX_BLOCKS: limits.max_blocks,
                    "secondsAtMaxBlocks": round(clock.at_max_blocks, 1),
                    MAX_CONCURRENT: limits.max_concurrent,
                    "secondsAtMaxConcurrent": round(clock.at_max_concurrent, 1)
                    if limits.max_concurrent is not None else None,
                    "maxTokens": limits.max_tokens,
                    "meanHeld": round(clock.held_block_seconds / span, 1) if span else 0.0,
                    "peakHeld": clock.peak_held,
                }
            out["ceilings"] = ceilings
        return out
