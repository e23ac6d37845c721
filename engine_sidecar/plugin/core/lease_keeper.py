"""Takes, renews and releases leases on vLLM's blocks, and keeps their accounts.

`leases.LeaseTable` decides which leases live; this part holds the block references
they stand for (one per block, taken before a replaced lease drops its own, so a
shared prefix never reaches refcount 0), and books why each lease ended.
"""

from __future__ import annotations

from engine_sidecar.plugin.core.engine_port import Block, Engine
from engine_sidecar.plugin.core.retention import Retention
from engine_sidecar.plugin.core.tenant_state import TenantState
from engine_sidecar.plugin.core.victim_order import StepView
from engine_sidecar.plugin.rules.leases import Lease, LeaseDrop, lease_block_cap
from engine_sidecar.plugin.rules.ranking import RankKey, Reason, VictimRanker


class LeaseKeeper:
    def __init__(self, state: TenantState, engine: Engine, retention: Retention) -> None:
        self._state = state
        self._engine = engine
        self._retention = retention

    def take(self, key: tuple[str, str], req_id: str, seconds: int) -> None:
        """Lease the cached blocks a finished request of session `key` leaves."""
        state = self._state
        policy = state.policy
        blocks = self._engine.cached_blocks(req_id)
        cap = lease_block_cap(policy, key[0])
        if cap:
            blocks = blocks[:cap]
        if not blocks:
            return  # nothing cached (e.g. aborted before prefill): keep any older lease
        self._engine.pin_blocks(blocks)
        now = state.clock()
        pauses = state.pauses
        hold = pauses.hold_seconds(key)
        lease = Lease(key[0], key[1], blocks, now, now + min(seconds, hold), hold,
                      pauses.return_pause(key))
        for old, drop in state.leases.put(lease, policy):
            self.unpin(old, drop)

    def release(self, lease: Lease[Block], reason: Reason, view: StepView) -> None:
        """Release a live lease under memory pressure."""
        self._state.leases.pop(lease.key)
        self.unpin(lease, reason)
        view.debit(lease.tenant, lease.num_blocks)

    def release_expired(self, now: float) -> bool:
        expired = self._state.leases.pop_expired(now)
        for lease in expired:
            self.unpin(lease, LeaseDrop.EXPIRED)
        return bool(expired)

    def apply_policy(self) -> None:
        for lease, drop in self._state.leases.apply_policy(self._state.policy):
            self.unpin(lease, drop)

    def drop_all(self) -> None:
        for lease in self._state.leases.pop_all():
            self.unpin(lease, LeaseDrop.RESET)

    def unpin(self, lease: Lease[Block], why: Reason | LeaseDrop | None) -> None:
        """Drop a lease's references (the caller has taken it out of the table)."""
        state = self._state
        now = state.clock()
        self._engine.unpin_blocks(lease.blocks)
        self._retention.freed(lease.blocks, now)
        if why is None:
            return  # renewed: its session came back
        counters = state.tally(lease.tenant)
        # It ended before its session came back: what it held meanwhile bought nothing.
        counters.idle_lease_block_seconds += lease.num_blocks * max(
            0.0, min(now, lease.expires_at) - lease.last_activity
        )
        if why is not LeaseDrop.POLICY and why is not LeaseDrop.RESET:
            state.pauses.lease_lapsed(lease.tenant)
        if isinstance(why, LeaseDrop):
            counters.lease_drops[why] += 1
            return
        counters.preemptions[why] += 1
        counters.lease_breaks += 1
        if why is Reason.DEGRADED:
            counters.degraded_events += 1
            state.degraded.note_release(lease.tenant, lease.num_blocks)

    def best(
        self,
        ranker: VictimRanker,
        bound: RankKey | None,
        own_session: tuple[str, str] | None,
        *,
        idle_only: bool = False,
        tenant: str | None = None,
    ) -> Lease[Block] | None:
        """The lease to release next: the largest key above `bound` (any if None),
        only among `tenant`'s leases if given.

        The requester's own session is never a candidate (its blocks are the prefix
        it is about to reuse); with `idle_only`, sessions with a request in the
        engine are not either (their lease is what makes that request a hit)."""
        best: Lease[Block] | None = None
        best_key: RankKey | None = None
        active = self._state.active
        for lease in self._state.leases:
            if lease.key == own_session or (idle_only and lease.key in active):
                continue
            if tenant is not None and lease.tenant != tenant:
                continue
            key = ranker.lease_key(lease)
            if bound is not None and key <= bound:
                continue
            if best_key is None or key > best_key:
                best, best_key = lease, key
        return best
