"""Pool-wide admission on the shared ledger (`store`), for what routing cannot see.

When routing concentrates a tenant on a few engines, its guarantee idles on the others
while the per-engine split refuses it here. With a store, a request the split would
refuse (blocks or concurrency) is decided again against the tenant's pool-wide
maxBlocks and maxConcurrentRequests (the engine's capacity checks still apply), and
admitted if one check-and-charge on the store allows it. A borrower here that the
watermark would refuse is decided again with the watermark's room too (`rules.decide`,
`pool_guarantee`), and admitted if the store finds its tenant within its pool-wide
guarantee, this request included. Within what this sidecar has
claimed (its allowance) nothing goes to the store; a store down or slow leaves it to
what it had claimed, never above the pool-wide maxBlocks; a sidecar that never reached
its store keeps the split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.rules import Decision, PoolView, Verdict
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.pool.store import Limits, Outcome
from engine_sidecar.gateway.pool.worker import Inline, Runner


class Decide(Protocol):
    """`rules.decide` for one request, with the tenant policy given."""

    def __call__(self, tenant: TenantPolicy, *, pool_guarantee: bool = False) -> Verdict: ...


class _Load(Protocol):
    """What one tenant's requests hold here (`PoolView.tenant`)."""

    @property
    def charged(self) -> int: ...
    @property
    def inflight(self) -> int: ...


class ClaimStore(Protocol):
    """What admission needs of the ledger (`store.PoolStore`; the twin's model)."""

    @property
    def ttl_s(self) -> float: ...
    @property
    def ever_reached(self) -> bool: ...
    @property
    def reachable(self) -> bool: ...
    def sync(self, tenant: str, blocks: int, requests: int) -> None: ...
    def take(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool: ...
    def allows(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool: ...
    def charge(self, tenant: str, blocks: int, limits: Limits, requests: int = 1, *,
               within_guarantee: bool = False) -> Outcome: ...
    def released(self, tenant: str, blocks: int, requests: int) -> bool: ...
    def refresh(self, limits: Mapping[str, Limits] | None = None) -> bool: ...


_CHARGED = (Outcome.LOCAL, Outcome.POOL)  # the store counts them as held here
_SPLIT_REFUSALS = (Decision.REJECTED_QUOTA, Decision.REJECTED_CONCURRENCY)
# A tenant the store refused asks again no sooner than this (or a refresh, or a request
# of its ending here), whatever the pumps: each ask is a round trip.
REASK_S = 0.05


def limits_of(tenant: TenantPolicy) -> Limits | None:
    """The store's limits for `tenant`: pool-wide, and this engine's split as the most
    its allowance may grow to (None: the policy has no pool-wide quota for it)."""
    pool = tenant.pool_wide
    if pool is None:
        return None
    return Limits(max_blocks=pool.max_blocks, ceiling_blocks=tenant.max_blocks_per_engine,
                  max_requests=pool.max_concurrent_requests,
                  ceiling_requests=tenant.max_concurrent_requests,
                  guaranteed_blocks=pool.guaranteed_blocks)


def pool_wide(tenant: TenantPolicy) -> TenantPolicy:
    """The tenant as admission sees it when the store has granted it the pool's room."""
    assert tenant.pool_wide is not None
    return tenant.model_copy(update={
        "max_blocks_per_engine": max(tenant.max_blocks_per_engine, tenant.pool_wide.max_blocks),
        "max_concurrent_requests": tenant.pool_wide.max_concurrent_requests,
    })


class PoolAdmission:
    """Wraps one sidecar's decisions with the pool-wide ledger."""

    def __init__(self, store: ClaimStore, runner: Runner | None = None,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.store = store
        # Where a round trip runs (the sidecar's store thread: never its event loop) and
        # what an answer wakes (the queue's pump). Inline: answered at once.
        self.runner: Runner = runner if runner is not None else Inline()
        self.wake = wake
        # Asks sent and not yet answered, and answers not yet used, per (tenant, asked
        # about its guarantee); an answer is what the store said to `blocks` more.
        self._asking: set[tuple[str, bool]] = set()
        self._answers: dict[tuple[str, bool], tuple[int, Outcome, int]] = {}
        self._generation = 0  # refreshes so far: a grant nobody took lasts one
        self.charges = {outcome: 0 for outcome in Outcome}  # what decisions needed
        # (tenant, asked about its guarantee) -> when the store last said no: its queued
        # requests do not ask the same again at every pump, only once the claims may
        # have moved (REASK_S, a request's end here, the refresh).
        self._noes: dict[tuple[str, bool], float] = {}
        self.within_guarantee = 0  # admitted into the watermark's room on the store's word

    def decide(self, tenant: TenantPolicy, view: PoolView, run: Decide,
               now: float = 0.0, final: bool = False) -> Verdict:
        """`run(tenant)`: `rules.decide` for this request with that tenant policy;
        `now`: the queue's clock; `final`: a refusal would be the request's answer, so
        the store is asked even if it refused the tenant within REASK_S."""
        verdict = run(tenant)
        limits = limits_of(tenant)
        if limits is None:
            return verdict
        if verdict.decision is Decision.REJECTED_WATERMARK:
            return self._guaranteed(tenant, view, run, verdict, limits, now, final)
        if not (verdict.admitted or verdict.decision in _SPLIT_REFUSALS):
            return verdict
        load = view.tenant(tenant.tenant_id)
        asked = self._said_no(tenant.tenant_id, False, now, final)
        if verdict.admitted and not verdict.above_max:
            if asked:  # no round trip: within the allowance, or refused as last time
                self._sync(tenant.tenant_id, load)
                if not self.store.allows(tenant.tenant_id, verdict.blocks, limits):
                    return _full(tenant, load.charged, verdict)
            charged = self._charge(tenant, load, verdict, limits)
            if charged is None:  # asking the store: it waits for the answer
                return _full(tenant, load.charged, verdict)
            return charged if asked else self._answered(tenant.tenant_id, False, now, charged)
        # Refused by the split (or admitted only into idle KV beyond it): try the pool.
        if asked:
            return verdict
        wide = run(pool_wide(tenant))
        if wide.decision is Decision.REJECTED_WATERMARK:
            return self._guaranteed(pool_wide(tenant), view, run, verdict, limits, now, final)
        if not wide.admitted or wide.above_max:
            return verdict
        granted = self._charge(tenant, load, wide, limits)
        if granted is None:
            return verdict
        granted = self._answered(tenant.tenant_id, False, now, granted)
        return granted if granted.admitted else verdict

    def asking(self, tenant_id: str) -> bool:
        """A round trip for `tenant_id` is under way: its queued requests are not
        refused before the store's answer (the pump runs again when it comes)."""
        return any(key[0] == tenant_id for key in self._asking)

    def _guaranteed(self, tenant: TenantPolicy, view: PoolView, run: Decide,
                    refused: Verdict, limits: Limits, now: float, final: bool) -> Verdict:
        """A borrower the watermark refuses here, admitted into the watermark's room if
        the store finds its tenant within its pool-wide guarantee (one round trip, asked
        again no sooner than REASK_S after a no); else `refused`."""
        tenant_id = tenant.tenant_id
        if not limits.guaranteed_blocks or self._said_no(tenant_id, True, now, final):
            return refused
        verdict = run(tenant, pool_guarantee=True)
        if not verdict.admitted:
            return refused
        load = view.tenant(tenant_id)
        self._sync(tenant_id, load)
        outcome = self._ask(tenant_id, True, verdict.blocks, limits, load)
        if outcome is None:
            return refused
        self.charges[outcome] += 1
        if outcome is not Outcome.POOL:
            self._noes[(tenant_id, True)] = now
            return refused
        self._noes.pop((tenant_id, True), None)
        self.within_guarantee += 1
        return verdict

    def _sync(self, tenant_id: str, load: _Load) -> None:
        """The store's claim for `tenant_id` is what its requests hold here, plus what
        the store granted that no request has taken yet."""
        granted = [blocks for (tenant, _), (blocks, outcome, _) in self._answers.items()
                   if tenant == tenant_id and outcome in _CHARGED]
        self.store.sync(tenant_id, load.charged + sum(granted), load.inflight + len(granted))

    def _ask(self, tenant_id: str, within: bool, blocks: int, limits: Limits,
             load: _Load) -> Outcome | None:
        """The store's answer to `blocks` more for `tenant_id`: within the allowance at
        once; else the answer a round trip brought, or None while it is under way (the
        runner answers at once inline; the store thread wakes the pump)."""
        key = (tenant_id, within)
        answer = self._answers.pop(key, None)
        if answer is not None and (answer[1] not in _CHARGED or blocks <= answer[0]):
            if answer[1] in _CHARGED:  # charged on the store: this request holds it now
                self.store.sync(tenant_id, load.charged + blocks, load.inflight + 1)
            return answer[1]
        if self.asking(tenant_id):  # its claim is on its way: the answer decides
            return None
        if not within and self.store.take(tenant_id, blocks, limits):
            return Outcome.LOCAL
        store = self.store

        def ask() -> Outcome:
            try:
                return store.charge(tenant_id, blocks, limits, within_guarantee=within)
            except Exception:  # never leave an ask unanswered
                return Outcome.FALLBACK

        self._asking.add(key)
        self.runner.run(ask, lambda outcome: self._answer(key, blocks, outcome))
        answer = self._answers.pop(key, None)  # inline: answered already
        return None if answer is None else answer[1]

    def _answer(self, key: tuple[str, bool], blocks: int, outcome: Outcome) -> None:
        self._asking.discard(key)
        self._answers[key] = (blocks, outcome, self._generation)
        self.wake()

    def _said_no(self, tenant_id: str, guarantee: bool, now: float,
                 final: bool = False) -> bool:
        """The store said no to this ask for the tenant within REASK_S; for a request's
        final decision, at this very instant (the answer it is refused on: asking again
        for its next try in the same pump would keep it waiting on answers for ever)."""
        at = self._noes.get((tenant_id, guarantee))
        if final:
            return at == now
        return at is not None and now - at < REASK_S

    def _answered(self, tenant_id: str, guarantee: bool, now: float,
                  verdict: Verdict) -> Verdict:
        if verdict.admitted:
            self._noes.pop((tenant_id, guarantee), None)
        else:  # refused, or the store is down: a round trip that did not help
            self._noes[(tenant_id, guarantee)] = now
        return verdict

    def _charge(self, tenant: TenantPolicy, load: _Load, verdict: Verdict,
                limits: Limits) -> Verdict | None:
        """`verdict` if the store admits it, else refused; None while it is asked."""
        charged = load.charged
        self._sync(tenant.tenant_id, load)
        outcome = self._ask(tenant.tenant_id, False, verdict.blocks, limits, load)
        if outcome is None:
            return None
        self.charges[outcome] += 1
        if outcome in (Outcome.LOCAL, Outcome.POOL):
            return verdict
        if outcome is Outcome.FALLBACK and not self.store.ever_reached:
            # Never reached: nothing claimed anywhere for this sidecar; keep the split.
            return verdict if charged + verdict.blocks <= tenant.max_blocks_per_engine else _full(
                tenant, charged, verdict)
        return _full(tenant, charged, verdict)

    def released(self, tenant_id: str, view: PoolView) -> None:
        """A request of `tenant_id` ended: the store hears what its requests hold now
        when others may be waiting on it (`PoolStore.released`)."""
        load = view.tenant(tenant_id)
        for guarantee in (False, True):  # room here: its next request may fit
            self._noes.pop((tenant_id, guarantee), None)
        self.store.released(tenant_id, load.charged, load.inflight)

    def refresh(self, policy: EnginePolicy, view: PoolView) -> bool:
        """Republish what this sidecar's requests hold (call 3x per TTL). A grant no
        request took since the refresh before is given back."""
        self._noes.clear()
        self._answers = {key: answer for key, answer in self._answers.items()
                         if answer[2] == self._generation}
        self._generation += 1
        limits: dict[str, Limits] = {}
        for tenant_id, tenant in policy.tenants.items():
            lim = limits_of(tenant)
            if lim is None:
                continue
            limits[tenant_id] = lim
            self._sync(tenant_id, view.tenant(tenant_id))
        return self.store.refresh(limits)


def _full(tenant: TenantPolicy, charged: int, verdict: Verdict) -> Verdict:
    pool = tenant.pool_wide
    assert pool is not None
    return Verdict(Decision.REJECTED_QUOTA, verdict.max_tokens, verdict.blocks, ApiError(
        429, errors.TENANT_BLOCK_QUOTA_EXHAUSTED,
        f"tenant {tenant.tenant_id!r} holds or has reserved {charged} KV blocks on this "
        f"engine and its pool-wide total leaves no room for {verdict.blocks} more "
        f"(pool-wide maxBlocks {pool.max_blocks}). Retry later or lower max_tokens.",
    ), verdict.borrowing, verdict.new_blocks, verdict.extra, verdict.output_tokens)
