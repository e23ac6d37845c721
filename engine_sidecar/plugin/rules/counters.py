"""Per-tenant counters the stats file publishes, kept in the engine's memory.

Tenant ids the policy does not know share one key, so the number of label values
stays bounded by the policy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.policy import EnginePolicy


@dataclass
class CounterTally:
    """One tenant's monotonic counters in the plugin's memory, as the stats file
    publishes them (`contract.stats.TenantEngineStats`)."""

    preemptions: Counter[str] = field(default_factory=Counter)
    outgrown_preemptions: int = 0  # running victims that held more than they reserved
    lease_breaks: int = 0
    lease_drops: Counter[str] = field(default_factory=Counter)
    degraded_events: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    idle_lease_block_seconds: float = 0.0  # of leases that ended before their session came back


class CounterBook:
    """Counters by tenant; tenants the policy does not know share UNCLASSIFIED."""

    def __init__(self) -> None:
        self.tenants: dict[str, CounterTally] = {}

    def __getitem__(self, tenant: str) -> CounterTally:
        counters = self.tenants.get(tenant)
        if counters is None:
            counters = self.tenants[tenant] = CounterTally()
        return counters


def stats_tenant(policy: EnginePolicy | None, tenant: str | None) -> str:
    """The stats key of a tenant: itself if the policy knows it, else UNCLASSIFIED.

    Unknown ids are folded so that label cardinality stays bounded by the policy."""
    if tenant is not None and policy is not None and tenant in policy.tenants:
        return tenant
    return UNCLASSIFIED
