"""The tenant policy the scheduler plugin applies, kept free of vLLM so it is testable.

Everything here works on plain values (tenant ids, token counts, times, opaque block
handles); `engine_sidecar.plugin.scheduler` feeds it from vLLM's scheduler state.

Victim order (DESIGN.md §4), a total order over the candidates for giving blocks
back: running requests and live leases (the pinned blocks of an idle session). The
candidate with the largest key goes first:

1. expired leases, always first: they are released at the start of every step and
   before anything else when an allocation fails;
2. band: unclassified traffic (no tenant, or a tenant the policy does not know), then
   above-max work (requests the sidecar admitted beyond their tenant's `maxBlocks`, into
   KV nobody else wanted, `aboveMax: Reclaimable`; never leases), then borrowers
   (tenants whose usage, running + pinned blocks, is above `guaranteedBlocks`), then
   tenants within their guarantee;
3. tier: within a band, lower tier (larger `priority` number) first;
4. within a band and tier: live leases before running requests (an idle session's
   cache before work in flight), leases with the oldest activity first; then the
   running request that loses the least work (fewest computed tokens), ties newest
   arrival first. Unclassified requests keep vLLM's own priority-policy order,
   `(priority, arrival_time)`, so with no policy at all the plugin picks exactly
   vLLM's victims.

When a running request R needs blocks, the plugin releases live leases whose key is
above the key of the running request it would preempt next, then lets vLLM preempt
that request (possibly R itself). A waiting request W ranks as a running request that
has computed nothing, in the band its tenant would be in once it holds its blocks: it
takes blocks from leases whose key is above W's, then from running requests whose key
is above W's (preempted before the next step: vLLM itself admits waiting requests into
free blocks only), and only then from its own tenant's idle leases. The requester's own
session lease is never released for it (those blocks are the prefix it reuses), and
neither is the lease of a session with a request in the engine, except in degraded mode.

The admission rule is this order read the other way (`reclaimable_blocks`): what a new
request may count on is the free blocks above the watermark plus everything the victim
order gives back before it.

Growth (README: reservations): a request reserves its prompt plus an estimate of its
output (or max_tokens, for a tier whose reservation is `Full`), and its tenant is
charged what its requests hold plus what they reserved and have not allocated yet. A
request that decodes past its estimate draws first on its tenant's headroom up to
maxBlocks, then on free blocks above the watermark (admission holds back new work of
its tenant, then borrowers, meanwhile); when both are gone this victim order decides,
as for any other shortage: lower classes first, then the tenant's own newest work. A
tenant within its guarantee is never preempted for another tenant's benefit, and a
request within its tenant's guarantee is never refused for capacity.

Degraded mode: when nothing ranks above the requester and no other request is
running, waiting would stall the engine until leases expire. The plugin then
releases live leases in the same order (the oldest premium leases go last of all,
oldest first) until the request fits. A degraded episode is logged once and ends with
the first step in which no allocation failed.

Preemption reasons (`preemptions` in the stats): `unclassified`, `above_max`,
`borrower`, `tier`
(a running request within its guarantee) for running requests; `lease_break` and
`degraded` for live leases released under pressure. Across those reasons,
`outgrownPreemptions` counts the running victims that held more blocks than the
sidecar reserved for them (`RESERVED_BLOCKS_ARG`): the price of reserving estimates.
Leases that end without pressure are `leaseDrops` (`expired`, `cap`, `policy`,
`reset`), not evictions.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from engine_sidecar.contract.names import (
    ABOVE_MAX_ARG,
    RESERVED_BLOCKS_ARG,
    RESERVED_OUTPUT_ARG,
    SESSION_ARG,
    TENANT_ARG,
    UNCLASSIFIED,
)
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.contract.reclaim import Band

logger = logging.getLogger(__name__)

# Stats key for requests without a known tenant; tenant ids cannot start with "_".
_MAX_ID_LEN = 253

B = TypeVar("B")  # an opaque KV block handle (vLLM's KVCacheBlock in the engine)


class Reason(StrEnum):
    """Why blocks were taken from a tenant (`preemptions` keys in the stats)."""

    UNCLASSIFIED = "unclassified"  # a running request without a known tenant
    BORROWER = "borrower"  # a running request of a tenant above its guarantee
    ABOVE_MAX = "above_max"  # a running request of a tenant above its maxBlocks
    TIER = "tier"  # a running request within its guarantee (lower tier, or least work)
    LEASE_BREAK = "lease_break"  # a live lease released under memory pressure
    DEGRADED = "degraded"  # a live lease released because nothing else could progress


class LeaseDrop(StrEnum):
    """Why a lease ended without pressure (`leaseDrops` keys; not evictions)."""

    EXPIRED = "expired"
    CAP = "cap"  # lease.maxSessions / lease.maxBlocks made room for a newer session
    POLICY = "policy"  # the tenant lost its lease (or the tenant) in a policy change
    RESET = "reset"  # prefix cache reset / shutdown


_RUNNING_REASON = {
    Band.UNCLASSIFIED: Reason.UNCLASSIFIED,
    Band.ABOVE_MAX: Reason.ABOVE_MAX,
    Band.BORROWER: Reason.BORROWER,
    Band.GUARANTEED: Reason.TIER,
}


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str | None
    session: str | None
    reserved_blocks: int | None = None  # per sequence, as admitted (None: not told)
    above_max: bool = False  # admitted beyond its tenant's maxBlocks, into idle KV
    reserved_output: int | None = None  # of reserved_blocks, output tokens per sequence

    @property
    def session_key(self) -> tuple[str, str] | None:
        if self.tenant is None or self.session is None:
            return None
        return (self.tenant, self.session)


NO_IDENTITY = Identity(None, None)


def identity_from_extra_args(extra_args: Mapping[str, Any] | None) -> Identity:
    """Tenant and session as the sidecar set them through `vllm_xargs`.

    Anything that is not a non-empty string of sane length counts as absent: such a
    request is unclassified (and never leased)."""
    if not extra_args:
        return NO_IDENTITY
    tenant = _clean_id(extra_args.get(TENANT_ARG))
    session = _clean_id(extra_args.get(SESSION_ARG)) if tenant is not None else None
    if tenant is None:
        return NO_IDENTITY
    reserved = _count(extra_args.get(RESERVED_BLOCKS_ARG), 1)
    output = _count(extra_args.get(RESERVED_OUTPUT_ARG), 0) if reserved is not None else None
    return Identity(tenant, session, reserved, extra_args.get(ABOVE_MAX_ARG) is True, output)


def _count(value: object, least: int) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        return None
    return value


def outgrew(identity: Identity, num_blocks: int, num_prompt_tokens: int,
            block_size: int) -> bool:
    """Did a request holding `num_blocks` outgrow what the sidecar reserved for it?

    The sidecar may have reserved at its prompt's ceiling (admitted before counting):
    told the output part, the reservation is taken at the prompt the engine counted."""
    reserved = identity.reserved_blocks
    if reserved is None:
        return False
    if identity.reserved_output is not None:
        exact = -(-(num_prompt_tokens + identity.reserved_output) // block_size)
        reserved = min(reserved, exact)
    return num_blocks > reserved


def _clean_id(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= _MAX_ID_LEN:
        return value
    return None


@dataclass(slots=True)
class Lease(Generic[B]):
    """Pinned blocks of one idle session. The table owns one reference on each block."""

    tenant: str
    session: str
    blocks: list[B]
    last_activity: float
    expires_at: float
    pause_hold: float = math.inf  # SessionPauses.hold_seconds when the lease was taken
    pause: float | None = None  # SessionPauses.return_pause: None, no rhythm to go by

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session)

    def expected_return(self, now: float) -> float:
        """When its session should be back: one typical pause after its last activity,
        or, once overdue, one pause from now (no nearer than a fresh one). Without a
        rhythm every lease says `now`, and the caps fall back to the oldest first."""
        if self.pause is None:
            return now
        due = self.last_activity + self.pause
        return due if due > now else now + self.pause

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def lease_seconds(policy: EnginePolicy | None, tenant: str | None) -> int:
    """How long an idle session of `tenant` keeps its blocks (0: no lease)."""
    tenant_policy = policy.tenant(tenant) if policy is not None else None
    return tenant_policy.lease.seconds if tenant_policy is not None else 0


def lease_block_cap(policy: EnginePolicy | None, tenant: str) -> int:
    """The most blocks one lease of `tenant` may pin (0: no cap)."""
    tenant_policy = policy.tenant(tenant) if policy is not None else None
    return tenant_policy.lease.max_leased_blocks if tenant_policy is not None else 0


class SessionPauses:
    """How long an idle session is worth its lease, from the pauses it has shown.

    A lease lapses a few times the session's typical pause after its last activity,
    never later than the tenant's `lease.seconds` and never sooner than `MIN_HOLD_S`.
    The typical pause is an exponentially weighted mean of the session's observed gaps
    (end of a turn to the next request). A session with none yet gets the full
    `lease.seconds` the platform team declared: one tenant's sessions need not share a
    rhythm (an agent's loop and a person reading an answer), so its other sessions'
    pauses say little about this one's first. One thing the tenant's sessions do say:
    whether they come back at all. When none of the last `RETURN_WINDOW` leases of a
    tenant saw its session return (one-shot API calls that happen to carry a session
    id), a session with no pause of its own holds only `MIN_HOLD_S`; one return in that
    window restores the full lease. The tenant's typical pause also orders retention
    (`RetentionOrder`).

    How many times: think times of people and agents are roughly exponential. Were the
    session's mean pause known, `PAUSE_FACTOR` (4) times it would be enough: an
    exponential pause exceeds 4 means with probability e^-4 (under 2%), and an abandoned
    session gives its blocks back after 4 pauses instead of the whole lease (a chat
    that pauses 20 s for ever holds ~116 s, not 300 s). But the mean is estimated from
    the pauses seen, and a new pause X exceeds c times the mean of n earlier ones with
    probability (1 + c/n)^-n: 20% for c = 4 and one pause seen. So the factor is the c
    that keeps that chance at e^-4 for the evidence at hand, c(n) = n (e^(4/n) - 1):
    53.6 after one pause, 9.3 after three, 5.8 at the weighted mean's steady state
    (which rests on 1/sum(w^2) = 5.7 pauses' worth of evidence, taken as its n).
    A session that paused 0.4 s once is not yet known to come back within 1.6 s.
    Gaps are remembered for the `MAX_SESSIONS` most recent sessions.
    """

    PAUSE_FACTOR = 4.0
    MIN_HOLD_S = 10.0
    WEIGHT = 0.3  # of the newest gap in the mean
    MAX_SESSIONS = 65_536
    RETURN_WINDOW = 20  # a tenant's latest lease outcomes (came back or not) kept
    SPREAD_WEIGHT = 0.05  # of the newest gap in the tenant's spread (~20 gaps)
    REGULAR_SAMPLES = 20
    REGULAR_CV = 0.5

    def __init__(self) -> None:
        self._ended: dict[tuple[str, str], float] = {}  # session -> end of its last turn
        # session -> (weighted mean pause, sum of its weights squared)
        self._session_mean: dict[tuple[str, str], tuple[float, float]] = {}
        self._tenant_mean: dict[str, float] = {}
        self._returns: dict[str, deque[bool]] = {}  # tenant -> latest outcomes
        self._spread: dict[str, tuple[int, float, float]] = {}  # tenant -> n, E[gap], E[gap²]

    def _outcome(self, tenant: str, came_back: bool) -> None:
        window = self._returns.get(tenant)
        if window is None:
            window = self._returns[tenant] = deque(maxlen=self.RETURN_WINDOW)
        window.append(came_back)

    def lease_lapsed(self, tenant: str) -> None:
        """A lease of `tenant` ended before its session came back."""
        self._outcome(tenant, False)

    def comes_back(self, tenant: str) -> bool:
        """False once none of the tenant's last `RETURN_WINDOW` leases saw a return."""
        window = self._returns.get(tenant)
        return window is None or len(window) < self.RETURN_WINDOW or any(window)

    def turn_ended(self, key: tuple[str, str], now: float) -> None:
        ended = self._ended
        ended.pop(key, None)
        ended[key] = now  # newest last: the dict is the LRU order
        if len(ended) > self.MAX_SESSIONS:
            oldest = next(iter(ended))
            del ended[oldest]
            self._session_mean.pop(oldest, None)

    def turn_started(self, key: tuple[str, str], now: float) -> None:
        """A session sent a request: the gap since its last turn is a pause."""
        ended = self._ended.pop(key, None)
        if ended is None:
            return
        gap = max(0.0, now - ended)
        tenant = key[0]
        self._outcome(tenant, True)
        seen = self._session_mean.get(key)
        self._session_mean[key] = (gap, 1.0) if seen is None else (
            self._mix(seen[0], gap), seen[1] * (1 - self.WEIGHT) ** 2 + self.WEIGHT ** 2)
        self._tenant_mean[tenant] = self._mix(self._tenant_mean.get(tenant), gap)
        n, mean, square = self._spread.get(tenant, (0, gap, gap * gap))
        w = max(self.SPREAD_WEIGHT, 1.0 / (n + 1))
        self._spread[tenant] = (n + 1, mean + w * (gap - mean), square + w * (gap * gap - square))

    def _mix(self, mean: float | None, gap: float) -> float:
        return gap if mean is None else mean + self.WEIGHT * (gap - mean)

    def typical_pause(self, tenant: str) -> float | None:
        """The mean pause of `tenant`'s sessions, None before one was seen."""
        return self._tenant_mean.get(tenant)

    def regular(self, tenant: str) -> bool:
        """Do the tenant's pauses keep a rhythm (coefficient of variation at most
        `REGULAR_CV`, over at least `REGULAR_SAMPLES` of them)? Exponential think times
        have a CV of 1; people reading answers of similar length, far less."""
        n, mean, square = self._spread.get(tenant, (0, 0.0, 0.0))
        if n < self.REGULAR_SAMPLES or mean <= 0:
            return False
        return max(0.0, square - mean * mean) <= (self.REGULAR_CV * mean) ** 2

    def return_pause(self, key: tuple[str, str]) -> float | None:
        """The pause after which the session should be back, when its tenant's pauses
        are regular enough to say (`regular`): its own mean, else its tenant's."""
        if not self.regular(key[0]):
            return None
        own = self.session_pause(key)
        return own if own is not None else self._tenant_mean.get(key[0])

    def session_pause(self, key: tuple[str, str]) -> float | None:
        """The session's own typical pause, None before it showed one."""
        seen = self._session_mean.get(key)
        return seen[0] if seen is not None else None

    def hold_seconds(self, key: tuple[str, str]) -> float:
        """How long the lease of `key` should last after the session's last activity,
        before the tenant's `lease.seconds` caps it (inf: no pause of its own yet, and
        the tenant's sessions do come back)."""
        seen = self._session_mean.get(key)
        if seen is None:
            return math.inf if self.comes_back(key[0]) else self.MIN_HOLD_S
        typical, weights_squared = seen
        return max(self.MIN_HOLD_S, self.pause_factor(1.0 / weights_squared) * typical)

    @classmethod
    def pause_factor(cls, pauses_seen: float) -> float:
        """c(n) = n (e^(PAUSE_FACTOR / n) - 1): how many typical pauses to hold when the
        typical pause rests on `pauses_seen` of them (see the class docstring)."""
        return pauses_seen * math.expm1(cls.PAUSE_FACTOR / pauses_seen)


class RetentionOrder:
    """Which cache vLLM should evict first: tenants without leases before the others.

    vLLM's free queue is one LRU over every tenant's cached blocks. While the block it
    evicts next was freed longer ago than the leased tenants' sessions typically pause,
    the cache it flushes would rarely have been reused, LRU is right and is left alone.
    Once that horizon is shorter (a free-tier burst churning through the cache, say),
    the unleased cache of a premium session is usually gone before the session comes
    back: then the blocks a finished request of a tenant without leases leaves go to
    the front of the queue instead, so the next allocations take those first
    (`contended`). `protect_s` is the longest typical pause among the leased tenants.
    """

    def __init__(self) -> None:
        self._freed_at: dict[int, float] = {}  # block id -> when it was last freed

    def freed(self, block_ids: Iterable[int], now: float) -> None:
        freed_at = self._freed_at
        for block_id in block_ids:
            freed_at[block_id] = now

    def contended(self, next_evicted: int | None, now: float, protect_s: float) -> bool:
        if next_evicted is None:
            return False
        return now - self._freed_at.get(next_evicted, -math.inf) < protect_s


class LeaseTable(Generic[B]):
    """Leases by session, with per-tenant caps and expiry.

    The table never touches blocks itself: every method that ends leases returns them
    (with why), and the caller drops their references. `lease.maxBlocks` caps the
    distinct blocks a tenant's leases pin, as vLLM holds them: a system prompt that
    every session shares counts once, not once per session (`block_key` says which
    handles are the same block). Invariants: at most one lease per (tenant, session);
    `_pinned[tenant]` counts, per block, the tenant's leases that hold it;
    `_next_expiry` is <= every lease's `expires_at`, so `pop_expired` can skip the scan
    while nothing can have expired.
    """

    def __init__(self, block_key: Callable[[B], Hashable] = lambda block: block) -> None:
        self._leases: dict[tuple[str, str], Lease[B]] = {}
        self._pinned: dict[str, Counter[Hashable]] = {}
        self._block_key = block_key
        self._next_expiry = math.inf

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease[B]]:
        return iter(list(self._leases.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def get(self, key: tuple[str, str]) -> Lease[B] | None:
        return self._leases.get(key)

    def put(
        self, lease: Lease[B], policy: EnginePolicy | None
    ) -> list[tuple[Lease[B], LeaseDrop | None]]:
        """Add or renew a session's lease; returns the leases to release.

        The replaced lease of the same session comes back with reason None (a
        renewal, not a drop); older sessions of the tenant that no longer fit
        `lease.maxSessions` / `lease.maxBlocks` come back with reason CAP. The caller
        trims `lease.blocks` to `lease_block_cap()` before taking references.
        """
        released: list[tuple[Lease[B], LeaseDrop | None]] = []
        old = self.pop(lease.key)
        if old is not None:
            released.append((old, None))
        if lease.blocks:
            self._add(lease)
            self._next_expiry = min(self._next_expiry, lease.expires_at)
        released.extend((drop, LeaseDrop.CAP) for drop in self._enforce_caps(lease.tenant, policy))
        return released

    def touch(self, key: tuple[str, str], now: float, seconds: int) -> None:
        """A session was active: its lease lives `seconds` from now."""
        lease = self._leases.get(key)
        if lease is not None:
            lease.last_activity = now
            lease.expires_at = now + seconds
            self._next_expiry = min(self._next_expiry, lease.expires_at)

    def pop(self, key: tuple[str, str]) -> Lease[B] | None:
        lease = self._leases.get(key)
        if lease is not None:
            self._remove(lease)
        return lease

    def pop_expired(self, now: float) -> list[Lease[B]]:
        if now < self._next_expiry:
            return []
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self._remove(lease)
        self._next_expiry = min((x.expires_at for x in self._leases.values()), default=math.inf)
        return expired

    def pop_all(self) -> list[Lease[B]]:
        leases = list(self._leases.values())
        self._leases.clear()
        self._pinned.clear()
        self._next_expiry = math.inf
        return leases

    def apply_policy(self, policy: EnginePolicy | None) -> list[tuple[Lease[B], LeaseDrop]]:
        """Re-derive expiries and caps from a new policy; returns the leases it ends."""
        dropped: list[tuple[Lease[B], LeaseDrop]] = []
        for lease in list(self._leases.values()):
            seconds = lease_seconds(policy, lease.tenant)
            if seconds <= 0:
                self._remove(lease)
                dropped.append((lease, LeaseDrop.POLICY))
            else:
                lease.expires_at = lease.last_activity + min(seconds, lease.pause_hold)
        for tenant in {lease.tenant for lease in self._leases.values()}:
            dropped.extend((lease, LeaseDrop.CAP) for lease in self._enforce_caps(tenant, policy))
        self._next_expiry = min((x.expires_at for x in self._leases.values()), default=math.inf)
        return dropped

    def tenant_totals(self) -> dict[str, tuple[int, int]]:
        """tenant -> (leased sessions, leased blocks counted per lease)."""
        totals: dict[str, tuple[int, int]] = {}
        for lease in self._leases.values():
            sessions, blocks = totals.get(lease.tenant, (0, 0))
            totals[lease.tenant] = (sessions + 1, blocks + lease.num_blocks)
        return totals

    def pinned_blocks(self, tenant: str) -> int:
        """Distinct blocks the tenant's leases pin (what `lease.maxBlocks` caps)."""
        return len(self._pinned.get(tenant, ()))

    def _add(self, lease: Lease[B]) -> None:
        self._leases[lease.key] = lease
        pinned = self._pinned.setdefault(lease.tenant, Counter())
        pinned.update(map(self._block_key, lease.blocks))

    def _remove(self, lease: Lease[B]) -> None:
        del self._leases[lease.key]
        pinned = self._pinned[lease.tenant]
        for key in map(self._block_key, lease.blocks):
            if pinned[key] <= 1:
                del pinned[key]
            else:
                pinned[key] -= 1
        if not pinned:
            del self._pinned[lease.tenant]

    def _enforce_caps(self, tenant: str, policy: EnginePolicy | None) -> list[Lease[B]]:
        tenant_policy = policy.tenant(tenant) if policy is not None else None
        if tenant_policy is None:
            return []
        max_sessions = tenant_policy.lease.max_sessions
        max_blocks = tenant_policy.lease.max_leased_blocks
        if not max_sessions and not max_blocks:
            return []
        # The oldest activity goes first: with irregular (say exponential) pauses, the
        # longer a session has been idle, the likelier it is gone for good. But when a
        # tenant's sessions keep a rhythm (`SessionPauses.regular`: people reading long
        # answers), they come back in the order they left and the oldest is the next to
        # return: then the lease whose session should be back last goes first, as
        # dropping the oldest would drop the very next one to be used, every time.
        own = [lease for lease in self._leases.values() if lease.tenant == tenant]

        def over() -> bool:
            return bool(own) and bool(
                (max_sessions and len(own) > max_sessions)
                or (max_blocks and self.pinned_blocks(tenant) > max_blocks)
            )

        if not over():
            return []  # the common case: no sort
        now = max(lease.last_activity for lease in own)  # the newest lease's time
        own.sort(key=lambda lease: (-lease.expected_return(now), lease.last_activity))
        dropped: list[Lease[B]] = []
        while over():
            oldest = own.pop(0)
            self._remove(oldest)
            dropped.append(oldest)
        return dropped


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
        used = self.usage.get(tenant_policy.tenant_id, 0)
        return Band.BORROWER if used > tenant_policy.guaranteed_blocks else Band.GUARANTEED

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


class DegradedEpisodes:
    """Degraded-mode bookkeeping: one log line per episode, not per release."""

    def __init__(self, log: Callable[..., None] | None = None) -> None:
        self.active = False
        self.episodes = 0
        self.releases_in_episode = 0
        self._log = log or logger.warning

    def note_release(self, tenant: str, num_blocks: int) -> None:
        if not self.active:
            self.active = True
            self.episodes += 1
            self.releases_in_episode = 0
            self._log(
                "KVQuota degraded: KV cache exhausted with only higher-class work left; "
                "releasing live leases, oldest premium last (first: tenant %s, %d blocks)",
                tenant, num_blocks,
            )
        self.releases_in_episode += 1

    def end_step(self, allocation_failed: bool) -> bool:
        """Close the episode after a step without allocation failure; True if closed."""
        if self.active and not allocation_failed:
            self.active = False
            logger.info(
                "KVQuota degraded episode %d over after %d lease releases",
                self.episodes, self.releases_in_episode,
            )
            return True
        return False
