"""The pool-wide ledger in the twin: the shared store's rule (`pool_store`'s Lua scripts)
over one in-memory table, shared by the pool's engines.

Same claims as on the store, published when the store would see them (a charge that
needs it, a refresh, a release while the claim was above the allowance or the tenant
marked as the store last said), so the others decide on the same stale numbers: a
sidecar's claim on a tenant is the more of what its requests hold and its allowance
(what it admits with no round trip: its split, lowered to charge + margin on refresh for
a TTL after a refusal for the tenant); a claim grows only within what the others' claims
leave of the pool-wide limit; for a tenant with a pool-wide guarantee, when what it
holds leaves room, the others' allowances in the way are taken back first (each leans to
what it holds, at once: every sidecar answers in time here). No sidecar dies and the
store never fails here, so no TTL and no grace. Round trips are counted; each costs
`rtt_s`, which the report adds to the admissions that needed one (virtual time does not
wait for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine_sidecar.gateway.pool.store import Claim, Limits, Outcome, lean_margin

DEFAULT_RTT_S = 0.001  # a store in the same zone


@dataclass
class TwinLedger:
    """The store: sidecar -> tenant -> claim."""

    rtt_s: float = DEFAULT_RTT_S
    claims: dict[str, dict[str, Claim]] = field(default_factory=dict)
    round_trips: int = 0
    pressure: dict[str, float] = field(default_factory=dict)  # tenant -> refused at
    now: float = 0.0  # virtual time, set by the pool
    # The sidecars, each listening for requests to lean (all answer at once here).
    sidecars: dict[str, TwinPoolStore] = field(default_factory=dict)
    take_backs: int = 0  # charges that asked the others to lean

    def others(self, me: str, tenant: str) -> tuple[int, int]:
        blocks = requests = 0
        for sidecar, claims in self.claims.items():
            if sidecar != me and tenant in claims:
                b, r = claims[tenant].claimed()
                blocks, requests = blocks + b, requests + r
        return blocks, requests

    def pressured(self, tenant: str) -> bool:
        """Whether a sidecar was refused for `tenant` within one TTL (the store's mark)."""
        refused = self.pressure.get(tenant)
        return refused is not None and self.now - refused < TwinPoolStore.ttl_s

    def others_hold(self, me: str, tenant: str) -> int:
        """The blocks the other sidecars last published as held by `tenant`."""
        return sum(claims[tenant].blocks for sidecar, claims in self.claims.items()
                   if sidecar != me and tenant in claims)


class TwinPoolStore:
    """One engine's side (what `PoolAdmission` calls on `PoolStore`)."""

    ttl_s = 10.0
    ever_reached = True
    reachable = True

    def __init__(self, ledger: TwinLedger, sidecar: str, margin_blocks: int = 16,
                 margin_requests: int = 1) -> None:
        self.ledger = ledger
        self.me = sidecar
        self.margin = (margin_blocks, margin_requests)
        self.published = ledger.claims.setdefault(sidecar, {})  # what the store holds
        ledger.sidecars[sidecar] = self
        self.claims: dict[str, Claim] = {}  # this sidecar's own books
        self.limits: dict[str, Limits] = {}
        self.pressured: set[str] = set()  # as the store's last answer said
        self.releases_written = 0

    def _publish(self, tenant: str) -> None:
        claim = self.claims[tenant]
        self.published[tenant] = Claim(claim.blocks, claim.requests, claim.allow_blocks,
                                       claim.allow_requests)

    def sync(self, tenant: str, blocks: int, requests: int) -> None:
        claim = self.claims.setdefault(tenant, Claim())
        claim.blocks, claim.requests = max(0, blocks), max(0, requests)

    def _note_pressure(self, tenant: str) -> None:
        if self.ledger.pressured(tenant):
            self.pressured.add(tenant)
        else:
            self.pressured.discard(tenant)

    def lean(self, tenant: str) -> None:
        """Asked to lean (`PoolStore.lean`): the allowance becomes what it holds."""
        claim = self.claims.get(tenant)
        if claim is None or tenant not in self.limits:
            return
        claim.allow_blocks = min(claim.allow_blocks, claim.blocks)
        self.ledger.round_trips += 1
        self._publish(tenant)
        self._note_pressure(tenant)

    def released(self, tenant: str, blocks: int, requests: int) -> bool:
        """As `PoolStore.released`: written through when the claim was above the
        allowance or the store last said the tenant is under pressure."""
        claim, limits = self.claims.get(tenant), self.limits.get(tenant)
        if claim is None or limits is None or not claim.ended(
                blocks, requests, limits, tenant in self.pressured):
            return False
        self.ledger.round_trips += 1
        self.releases_written += 1
        mine = self.published.setdefault(tenant, Claim())
        mine.blocks, mine.requests = claim.blocks, claim.requests
        self._note_pressure(tenant)
        return True

    def allows(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool:
        claim = self.claims.get(tenant)
        return claim is not None and claim.allows(blocks, requests, limits)

    def take(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool:
        """As `PoolStore.take`: charged within the allowance, no round trip."""
        self.limits[tenant] = limits
        claim = self.claims.setdefault(tenant, Claim())
        if not claim.allows(blocks, requests, limits):
            return False
        claim.blocks, claim.requests = claim.blocks + blocks, claim.requests + requests
        return True

    def charge(self, tenant: str, blocks: int, limits: Limits, requests: int = 1, *,
               within_guarantee: bool = False) -> Outcome:
        self.limits[tenant] = limits
        claim = self.claims.setdefault(tenant, Claim())
        nb, nr = claim.blocks + blocks, claim.requests + requests
        if not within_guarantee and claim.allows(blocks, requests, limits):
            claim.blocks, claim.requests = nb, nr
            return Outcome.LOCAL
        self.ledger.round_trips += 1
        ob, orq = self.ledger.others(self.me, tenant)
        fits = ob + nb <= limits.max_blocks
        held = self.ledger.others_hold(self.me, tenant) + nb
        if within_guarantee and (limits.guaranteed_blocks is None
                                 or held > limits.guaranteed_blocks):
            self.ledger.pressure[tenant] = self.ledger.now  # releases written through
            self.pressured.add(tenant)
            return Outcome.REFUSED
        takeable = limits.guaranteed_blocks is not None and held <= limits.max_blocks
        if not fits and takeable and (
                limits.max_requests is None or orq + nr <= limits.max_requests):
            # What is held leaves room: the others' allowances are taken back (each leans to
            # what it holds, a round trip of its own), then the charge is retried.
            self.ledger.pressure[tenant] = self.ledger.now
            self.ledger.take_backs += 1
            for sidecar, other in self.ledger.sidecars.items():
                if sidecar != self.me:
                    other.lean(tenant)
            self.ledger.round_trips += 1
            ob, orq = self.ledger.others(self.me, tenant)
            fits = ob + nb <= limits.max_blocks
        if not fits or (limits.max_requests is not None and orq + nr > limits.max_requests):
            self.ledger.pressure[tenant] = self.ledger.now
            self.pressured.add(tenant)
            return Outcome.REFUSED
        self._note_pressure(tenant)
        claim.blocks, claim.requests = nb, nr
        mine = self.published.setdefault(tenant, Claim())
        mine.blocks, mine.requests = nb, nr
        return Outcome.POOL

    def refresh(self, limits: Mapping[str, Limits] | None = None) -> bool:
        if limits:
            self.limits.update(limits)
        self.ledger.round_trips += 1
        for tenant, lim in self.limits.items():
            claim = self.claims.setdefault(tenant, Claim())
            ob, orq = self.ledger.others(self.me, tenant)
            lean = self.ledger.pressured(tenant)
            want_b = (min(lim.ceiling_blocks, claim.blocks + lean_margin(
                self.margin[0], lim.ceiling_blocks)) if lean
                      else lim.ceiling_blocks)
            claim.allow_blocks = (want_b if want_b <= claim.allow_blocks
                                  else max(claim.allow_blocks, min(want_b, lim.max_blocks - ob)))
            if lim.max_requests is not None:
                cr = lim.ceiling_requests or 0
                want_r = (min(cr, claim.requests + lean_margin(self.margin[1], cr))
                          if lean else lim.ceiling_requests or 0)
                claim.allow_requests = (
                    want_r if want_r <= claim.allow_requests
                    else max(claim.allow_requests, min(want_r, lim.max_requests - orq)))
            self._publish(tenant)
            self._note_pressure(tenant)
        return True
