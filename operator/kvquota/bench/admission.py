"""The sidecar's admission on virtual time: the same decision, the same ledger.

`engine_sidecar.gateway.admission.decide` and `ledger.Ledger` are pure, so the twin
calls them exactly as the sidecar's `_admit` does; only the inputs differ. The sidecar
reads the plugin's stats from a file published twice a second, the twin from the
plugin directly, at the step the request arrives in.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_sidecar.gateway.admission import (
    Decision,
    RequestShape,
    TenantLoad,
    Verdict,
    capacity_view,
    decide,
)
from engine_sidecar.gateway.ledger import Ledger, Reservation
from engine_sidecar.policy import EnginePolicy
from engine_sidecar.stats import EngineStats

# Checked before anything that reads the engine's state (see `admission.decide`).
_STATELESS_REFUSALS = frozenset({Decision.REJECTED_PROMPT, Decision.REJECTED_CONCURRENCY})


class TwinGateway:
    def __init__(
        self, policy: EnginePolicy, *, retry_after: int, max_model_len: int | None
    ) -> None:
        self.policy = policy
        self.ledger = Ledger()
        self.retry_after = retry_after
        self.max_model_len = max_model_len

    def admit(
        self,
        tenant_id: str,
        prompt_tokens: int,
        requested_max_tokens: int | None,
        stats: Callable[[], EngineStats | None],
        last_stats: EngineStats | None = None,
    ) -> tuple[Verdict, Reservation | None]:
        """Decide like the sidecar; an admitted request holds its reservation.

        `stats()` returns the plugin's current stats (it may be costly). When
        `last_stats` is given it is tried first: refusals that do not depend on the
        engine's state (prompt length, concurrency) stand without fetching new ones."""
        if last_stats is not None:
            verdict = self._decide(tenant_id, prompt_tokens, requested_max_tokens, last_stats)
            if verdict.decision in _STATELESS_REFUSALS:
                return verdict, None
        verdict = self._decide(tenant_id, prompt_tokens, requested_max_tokens, stats())
        if not verdict.admitted:
            return verdict, None
        return verdict, self.ledger.reserve(tenant_id, verdict.blocks)

    def _decide(
        self,
        tenant_id: str,
        prompt_tokens: int,
        requested_max_tokens: int | None,
        stats: EngineStats | None,
    ) -> Verdict:
        tenant = self.policy.tenants[tenant_id]
        shape = RequestShape((prompt_tokens,), requested_max_tokens)
        engine = stats.tenants.get(tenant_id) if stats else None
        load = TenantLoad(
            self.ledger.reserved_blocks(tenant_id),
            engine.leased_blocks if engine else 0,
            self.ledger.inflight(tenant_id),
        )
        return decide(
            tenant, shape,
            block_size=self.policy.block_size,
            watermark=self.policy.watermark,
            load=load,
            capacity=capacity_view(self.policy.capacity_blocks, stats, self.ledger.total_blocks),
            max_model_len=self.max_model_len,
            retry_after=self.retry_after,
        )
