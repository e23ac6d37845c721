"""What the plugin knows about the engine's tenants, in one object its parts share.

The policy in force, who each request belongs to, which sessions have a request in the
engine, the leases and the counters: every part of the plugin reads and updates this
state, and none keeps a copy of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.plugin.core.engine_port import Block
from engine_sidecar.plugin.policy_watch import PolicyWatcher
from engine_sidecar.plugin.rules.counters import CounterBook, CounterTally, stats_tenant
from engine_sidecar.plugin.rules.degraded import DegradedEpisodes
from engine_sidecar.plugin.rules.identity import NO_IDENTITY, Identity
from engine_sidecar.plugin.rules.leases import LeaseTable
from engine_sidecar.plugin.rules.pauses import SessionPauses


@dataclass
class TenantState:
    clock: Callable[[], float]
    watcher: PolicyWatcher
    leases: LeaseTable[Block]
    # req_id -> identity, for the requests in the engine that carry one.
    ids: dict[str, Identity] = field(default_factory=dict)
    # Sessions with a request in the engine: their lease is not idle.
    active: Counter[tuple[str, str]] = field(default_factory=Counter)
    pauses: SessionPauses = field(default_factory=SessionPauses)
    counters: CounterBook = field(default_factory=CounterBook)
    degraded: DegradedEpisodes = field(default_factory=DegradedEpisodes)

    @property
    def policy(self) -> EnginePolicy | None:
        return self.watcher.policy

    def identity(self, req_id: str) -> Identity:
        return self.ids.get(req_id, NO_IDENTITY)

    def tally(self, tenant: str | None) -> CounterTally:
        """The counters `tenant` is reported under."""
        return self.counters[stats_tenant(self.watcher.policy, tenant)]
