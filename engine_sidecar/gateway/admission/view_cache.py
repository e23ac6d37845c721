"""Admission's view of one engine, rebuilt only when what it is made of moves: the
ledger (its version), the plugin's stats (a new reading) or the policy."""

from __future__ import annotations

from collections.abc import Callable

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.rules import PoolView, engine_holders, pool_view


class ViewCache:
    def __init__(self, ledger: Ledger, stats: Callable[[], EngineStats | None]) -> None:
        self.ledger = ledger
        self.stats = stats
        # The tenants the engine reports holding blocks, when the stats or policy move.
        self._seen: tuple[EngineStats | None, EnginePolicy | None] | None = None
        self._holders: frozenset[str] = frozenset()
        self._version = -1
        self._view: PoolView | None = None

    def forget(self) -> None:
        """The policy changed: rebuild at the next read."""
        self._seen = None

    def view(self, policy: EnginePolicy) -> PoolView:
        stats = self.stats()
        seen = self._seen
        if seen is None or seen[0] is not stats or seen[1] is not policy:
            self._seen = (stats, policy)
            self._holders = engine_holders(policy, stats)
            self._view = None
        if self._view is None or self._version != self.ledger.version:
            self._view = pool_view(policy, stats, self.ledger, self._holders)
            self._version = self.ledger.version
        return self._view
