"""Admission decisions (DESIGN.md section 4), pure: no I/O, no clock, no globals.

The rule agrees with preemption: a request may count as available the free blocks
above the watermark plus every block the plugin's victim order would give back before
its own class (`contract.reclaim.reclaimable_blocks`). A tenant is charged what its
admitted requests take now plus one joint bound on their growth (`joint_charge`; `Full`
tiers: max_tokens in full), or what its running requests hold in the engine when more.
Blocks count once each, as vLLM holds them (shared prefixes, a session's leased blocks).

Checks, cheapest first, the most specific reason winning: prompt length (400) -> larger
than the tenant's whole quota (400) -> larger than the engine could ever give it
(`_never_fits`, 400) -> concurrency (429) -> block quota (429) -> capacity for
borrowers (503). 400s are final; the others wait in the queue
(`Verdict.waits`). Above maxBlocks only with `aboveMax: Reclaimable`: docs/gateway.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Mapping
from dataclasses import dataclass
from enum import StrEnum

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.contract.reclaim import (
    Band,
    Holding,
    reclaimable_blocks,
    requester_band,
    watermark_floor,
)
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.admission.joint_charge import NO_GROWTH, Remainder, in_blocks
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.output_estimate import Outlook
from engine_sidecar.gateway.errors import ApiError


class Decision(StrEnum):
    ADMITTED = "admitted"
    REJECTED_QUOTA = "rejected_quota"
    REJECTED_CONCURRENCY = "rejected_concurrency"
    REJECTED_WATERMARK = "rejected_watermark"
    REJECTED_PROMPT = "rejected_prompt"
    REJECTED_AUTH = "rejected_auth"


@dataclass(frozen=True)
class RequestShape:
    """What admission needs from a request body."""

    prompt_tokens: tuple[int, ...]  # one entry per prompt (completions may batch)
    requested_max_tokens: int | None
    n: int = 1
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    session: str | None = None
    prefix: tuple[int, ...] = ()  # fingerprints of the prompts' full blocks (`prefix`)
    route: str = ""  # the API route's kind (output estimates are learned per route)


@dataclass(frozen=True)
class _TenantView:
    """One tenant in the pool view: the ledger's reservations beside the plugin's stats."""

    reserved: int  # what the ledger charges: what its requests take now + `bound`
    inflight: int
    held: int  # distinct blocks in the engine: running + lease-only
    pinned: int  # distinct blocks its leases pin (shared with running ones or not)
    lease_only: int  # pinned blocks no running request shares
    pinned_in_use: int  # lease blocks of sessions with a request in flight
    growth: int  # reserved blocks not allocated yet
    leases: Mapping[str, int]  # session -> blocks its lease pins
    sessions: frozenset[str]  # sessions with a request in flight
    held_prefix: Container[int] = ()  # prefix fingerprints its in-flight requests hold
    running: int = 0  # blocks its running requests hold in the engine (the plugin's stats)
    remainder: Remainder = NO_GROWTH  # its requests' summed growth still to come
    bound: int = 0  # remainder.bound, computed once per view
    beyond_max: int = 0  # what its requests admitted beyond its maxBlocks take (ledger)

    @property
    def charged(self) -> int:
        """THE number admission compares with guaranteedBlocks and maxBlocks: what the
        ledger charges its requests (what they take now plus the joint bound on how far
        that will still grow, `joint_charge`), or what its running requests hold in the
        engine (the plugin's stats) when that is more: requests that outgrew the bound,
        or a response the sidecar cannot follow token by token, are charged the blocks
        they really hold. Not held + bound: the sidecar's count of decoded tokens trails
        the engine's, so the two sides would count the same tokens twice."""
        return max(self.reserved, self.running)


_NO_TENANT = _TenantView(0, 0, 0, 0, 0, 0, 0, {}, frozenset())


@dataclass(frozen=True)
class PoolView:
    """The engine's KV as admission sees it; `total_blocks` None: unknown capacity, so
    no capacity check (`free_blocks` already leaves out growth still to be allocated)."""

    total_blocks: int | None
    free_blocks: int
    source: str | None  # "engine", "policy" or None (unknown)
    unclassified: int = 0  # blocks held by requests of no known tenant
    tenants: Mapping[str, _TenantView] | None = None
    policy: EnginePolicy | None = None

    @property
    def known(self) -> bool:
        return self.total_blocks is not None

    def tenant(self, tenant_id: str) -> _TenantView:
        return (self.tenants or {}).get(tenant_id, _NO_TENANT)

    def holding(self, tenant_id: str, pinned_in_use: int | None = None) -> Holding:
        policy = self.policy.tenants.get(tenant_id) if self.policy else None
        t = self.tenant(tenant_id)
        in_use = t.pinned_in_use if pinned_in_use is None else pinned_in_use
        return Holding(
            priority=policy.priority if policy else 0,
            guaranteed=policy.guaranteed_blocks if policy else 0,
            used=t.held + t.growth,
            held=t.held,
            idle_leased=min(t.lease_only, max(0, t.pinned - in_use)),
            above_max=min(t.running, t.beyond_max),
        )

    def reclaimable(self, tenant_id: str, band: Band, pinned_in_use: int) -> int:
        """What the victim order gives back before a new request of `tenant_id`."""
        tenant = self.policy.tenants.get(tenant_id) if self.policy else None
        others = (self.holding(t) for t in (self.tenants or {}) if t != tenant_id)
        return reclaimable_blocks(
            band, tenant.priority if tenant else 0, others, unclassified=self.unclassified,
            own=self.holding(tenant_id, pinned_in_use),
        )


UNKNOWN_CAPACITY = PoolView(None, 0, None)
_NO_STATS = TenantEngineStats()


def _usable(stats: EngineStats | None) -> EngineStats | None:
    """The plugin's stats, when they know the engine's capacity."""
    return stats if stats is not None and stats.total_blocks > 0 else None


def engine_holders(policy: EnginePolicy, stats: EngineStats | None) -> frozenset[str]:
    """The policy's tenants that the plugin reports holding blocks (running, leased or
    pinned). With the ledger's tenants they are the only ones whose view is not empty:
    an idle tenant is `_NO_TENANT`, so a policy of a thousand tenants costs a decision
    only the ones that hold something (computed once per stats file, not per decision)."""
    engine = _usable(stats)
    if engine is None:
        return frozenset()
    return frozenset(
        tenant_id for tenant_id, seen in engine.tenants.items()
        if tenant_id in policy.tenants
        and (seen.running_blocks or seen.leased_blocks or seen.pinned_blocks or seen.leases)
    )


def pool_view(
    policy: EnginePolicy, stats: EngineStats | None, ledger: Ledger,
    holders: Collection[str] | None = None,
) -> PoolView:
    """Free blocks and per-tenant holdings from the plugin's stats and the ledger.

    What a tenant's requests take is partly allocated already (it shows in the engine's
    used blocks, and a queued follow-up's prefix is pinned by its lease): growth still to
    come is the excess of what they take over those, plus the joint bound on their
    remainders.
    Without stats every reservation counts and nothing is known to be reclaimable.
    `holders`: `engine_holders(policy, stats)`, when the caller keeps it."""
    override = policy.capacity_blocks
    engine = _usable(stats)
    engine_total = engine.total_blocks if engine is not None else None
    if holders is None:
        holders = engine_holders(policy, stats)
    tenants: dict[str, _TenantView] = {}
    growth_total = 0
    for tenant_id in {*holders, *ledger.tenants()}:
        seen = (engine.tenants.get(tenant_id) if engine else None) or _NO_STATS
        reserved = ledger.reserved_blocks(tenant_id)
        committed = ledger.committed_blocks(tenant_id)
        remainder = ledger.growth(tenant_id)
        sessions = ledger.sessions(tenant_id)
        pinned_in_use = sum(seen.leases.get(s, 0) for s in sessions)
        growth = max(0, reserved - max(seen.running_blocks, pinned_in_use))
        growth_total += growth
        tenants[tenant_id] = _TenantView(
            reserved=reserved,
            inflight=ledger.inflight(tenant_id),
            held=seen.running_blocks + seen.leased_blocks,
            pinned=seen.pinned_blocks,
            lease_only=seen.leased_blocks,
            pinned_in_use=pinned_in_use,
            growth=growth,
            leases=seen.leases,
            sessions=sessions,
            held_prefix=ledger.held_prefix(tenant_id),
            running=seen.running_blocks,
            remainder=remainder,
            bound=reserved - committed,
            beyond_max=ledger.beyond_max_blocks(tenant_id),
        )
    total = override or engine_total
    if total is None:
        return PoolView(None, 0, None, tenants=tenants, policy=policy)
    used = max(0, engine.total_blocks - engine.free_blocks) if engine else 0
    unclassified = engine.tenants.get(UNCLASSIFIED) if engine else None
    return PoolView(
        total, max(0, total - used - growth_total), "policy" if override else "engine",
        unclassified=unclassified.running_blocks if unclassified else 0,
        tenants=tenants, policy=policy,
    )


def effective_max_tokens(
    tenant: TenantPolicy, shape: RequestShape, max_model_len: int | None
) -> int:
    """Clamp to the tenant's ceiling; default when absent (fitting the model length)."""
    if shape.requested_max_tokens is not None:
        return min(shape.requested_max_tokens, tenant.max_tokens)
    default = tenant.default_max_tokens
    if max_model_len and shape.prompt_tokens:
        room = max_model_len - max(shape.prompt_tokens)
        if room >= 1:
            default = min(default, room)
    return default


def reserved_output(max_tokens: int, output_tokens: int | None) -> int:
    """The output tokens a request reserves: its estimate capped by its max_tokens
    (`output_tokens` None: the tier reserves Full, max_tokens)."""
    return max_tokens if output_tokens is None else max(0, min(max_tokens, output_tokens))


def blocks_for(shape: RequestShape, max_tokens: int, block_size: int) -> int:
    """ceil((prompt + max_tokens) / blockSize) per sequence, every prompt times n
    (`max_tokens`: the output tokens counted, the reserved estimate or max_tokens)."""
    return sum(
        shape.n * math.ceil((prompt + max(max_tokens, 0)) / block_size)
        for prompt in shape.prompt_tokens
    )


def sequence_blocks(shape: RequestShape, output_tokens: int, block_size: int) -> int:
    """What one sequence of the request reserves (its longest prompt): the plugin counts
    a victim holding more as one that outgrew its estimate."""
    longest = max(shape.prompt_tokens, default=0)
    return math.ceil((longest + max(output_tokens, 0)) / block_size)


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    max_tokens: int
    blocks: int  # what the tenant's reserved blocks grow by (shared prefix counted once)
    error: ApiError | None = None
    borrowing: bool = False  # it would take its tenant beyond its guarantee
    new_blocks: int = 0  # what the engine must allocate (its session's leased prefix out)
    extra: int = 0  # the blocks beyond the prompt's full blocks (ledger.reserve)
    output_tokens: int = 0  # per sequence: its 90th percentile (max_tokens if Full)
    remainder: Remainder = NO_GROWTH  # what it may still grow (ledger.reserve)
    above_max: bool = False  # admitted beyond its tenant's maxBlocks, into idle KV

    @property
    def admitted(self) -> bool:
        return self.decision is Decision.ADMITTED

    @property
    def waits(self) -> bool:
        """Not admitted now, but it may be once capacity frees (429 / 503)."""
        return self.error is not None and self.error.status in (429, 503)


def _never_fits(tenant: TenantPolicy, shape: RequestShape, view: PoolView, watermark: float,
                blocks: int, new_blocks: int, reserved: int, max_tokens: int) -> ApiError | None:
    """A 400 for a request no state of this engine could admit, so that a client does not
    wait in the queue and retry 503s for it: more new blocks than the engine has, or, for
    a request beyond its tenant's guarantee (a borrower whatever the tenant holds), more
    than a borrower can ever get, the blocks above the watermark (everything it counts
    as available, free and reclaimable, lies there). A tenant with a pool-wide guarantee
    may borrow the watermark's room too (`pool_guarantee`): only the engine's size binds."""
    assert view.total_blocks is not None
    total = view.total_blocks
    wide = tenant.pool_wide
    floor = 0 if wide is not None and wide.guaranteed_blocks else watermark_floor(
        watermark, total)
    if new_blocks <= total and (blocks <= tenant.guaranteed_blocks
                                or new_blocks <= total - floor):
        return None
    needs = (f"this request needs {new_blocks} new KV blocks on admission (prompt + "
             f"{reserved} output tokens per sequence, n={shape.n}, max_tokens={max_tokens})")
    if new_blocks > total:
        limit = f"the engine holds {total} KV blocks in all"
    else:
        limit = (f"tenant {tenant.tenant_id!r} is guaranteed {tenant.guaranteed_blocks} "
                 f"blocks, and beyond them a request can use at most the {total - floor} of "
                 f"the engine's {total} blocks above its {watermark:g} watermark")
    return ApiError(
        400, errors.REQUEST_EXCEEDS_ENGINE_CAPACITY,
        f"{needs}, but {limit}: it can never be admitted here. Lower max_tokens or n, "
        "or shorten the prompt.", param=shape.max_tokens_param)


def decide(
    tenant: TenantPolicy,
    shape: RequestShape,
    *,
    block_size: int,
    watermark: float,
    view: PoolView,
    max_model_len: int | None,
    outlook: Outlook | None = None,
    beyond_max: bool = False,
    pool_guarantee: bool = False,
) -> Verdict:
    """Admit or refuse now. `outlook`: what one of its sequences is expected to decode
    (`OutputEstimates.outlook`; None: max_tokens, the tier reserves Full).
    `beyond_max`: no other tenant's request waits for capacity, so a tenant whose
    `aboveMax` is Reclaimable may take free blocks above the watermark past its
    maxBlocks (README: above maxBlocks). `pool_guarantee`: the pool-wide ledger says
    its tenant stays within its pool-wide guarantee, so a borrower here may also take
    the free blocks the watermark keeps for guaranteed capacity: a borrower is the first
    its class gives back, so the engine's own guaranteed work still gets them."""
    max_tokens = effective_max_tokens(tenant, shape, max_model_len)
    full = blocks_for(shape, max_tokens, block_size)
    longest = max(shape.prompt_tokens, default=0)
    load = view.tenant(tenant.tenant_id)
    ahead = Outlook.exactly(max_tokens) if outlook is None else outlook.capped(max_tokens)
    reserved = math.ceil(ahead.quantile - 1e-9)  # the plugin counts a victim past it
    extra = max(0, blocks_for(shape, 0, block_size) - len(shape.prefix))
    own = in_blocks(ahead, shape.prompt_tokens, shape.n, 0, block_size, extra)
    after = load.remainder + own
    held = load.held_prefix
    blocks = extra + sum(1 for fingerprint in shape.prefix if fingerprint not in held)
    blocks += max(0, after.bound - load.bound)
    session_pinned = load.leases.get(shape.session, 0) if shape.session else 0
    new_blocks = max(min(extra, blocks), blocks - session_pinned)
    pinned_in_use = load.pinned_in_use
    if shape.session not in load.sessions:
        pinned_in_use += session_pinned

    def refuse(decision: Decision, error: ApiError, borrowing: bool = False) -> Verdict:
        return Verdict(decision, max_tokens, blocks, error, borrowing, new_blocks, extra,
                       reserved)

    if tenant.max_prompt_tokens is not None and longest > tenant.max_prompt_tokens:
        return refuse(Decision.REJECTED_PROMPT, ApiError(
            400, errors.PROMPT_TOO_LONG,
            f"the prompt has {longest} tokens; tenant {tenant.tenant_id!r} may send at most "
            f"{tenant.max_prompt_tokens}. Shorten the prompt.",
            param=shape.prompt_param,
        ))
    if max_model_len is not None and longest >= max_model_len:
        return refuse(Decision.REJECTED_PROMPT, ApiError(
            400, errors.PROMPT_TOO_LONG,
            f"the prompt has {longest} tokens; the model's context is {max_model_len} "
            "tokens, including the completion. Shorten the prompt.",
            param=shape.prompt_param,
        ))
    if full > tenant.max_blocks_per_engine:
        # Retrying can never help, so this is not a 429: even reserved at an estimate,
        # it may decode to max_tokens, more than its tenant may ever hold.
        return refuse(Decision.REJECTED_QUOTA, ApiError(
            400, errors.REQUEST_EXCEEDS_TENANT_QUOTA,
            f"this request needs {full} KV blocks (prompt + max_tokens={max_tokens}), "
            f"more than tenant {tenant.tenant_id!r} may hold on one engine "
            f"({tenant.max_blocks_per_engine}). Lower max_tokens or shorten the prompt.",
            param=shape.max_tokens_param,
        ))
    if view.known and (never := _never_fits(tenant, shape, view, watermark, blocks,
                                            new_blocks, reserved, max_tokens)) is not None:
        return refuse(Decision.REJECTED_WATERMARK, never)
    # The leases of sessions in flight are their requests' prefixes, reserved with them;
    # idle leases yield to the tenant's own new work: neither counts again.
    used = load.charged
    band = requester_band(used, blocks, tenant.guaranteed_blocks)
    borrowing = band is Band.BORROWER
    limit = tenant.max_concurrent_requests
    if limit is not None and load.inflight >= limit:
        return refuse(Decision.REJECTED_CONCURRENCY, ApiError(
            429, errors.TENANT_CONCURRENCY_EXHAUSTED,
            f"tenant {tenant.tenant_id!r} already has {load.inflight} requests in flight "
            f"(limit {limit} per engine). Retry after one finishes.",
        ), borrowing)
    if used + blocks > tenant.max_blocks_per_engine:
        if beyond_max and tenant.ceiling is not None and view.known:
            assert view.total_blocks is not None
            idle = view.free_blocks - watermark_floor(watermark, view.total_blocks)
            if new_blocks <= idle:
                return Verdict(Decision.ADMITTED, max_tokens, blocks, borrowing=True,
                               new_blocks=new_blocks, extra=extra, output_tokens=reserved,
                               remainder=own, above_max=True)
        return refuse(Decision.REJECTED_QUOTA, ApiError(
            429, errors.TENANT_BLOCK_QUOTA_EXHAUSTED,
            f"tenant {tenant.tenant_id!r} holds or has reserved {used} of its "
            f"{tenant.max_blocks_per_engine} KV blocks; this request needs {blocks} more. "
            "Retry later or lower max_tokens.",
        ), borrowing)
    if borrowing and view.known:
        assert view.total_blocks is not None
        floor = 0 if pool_guarantee else watermark_floor(watermark, view.total_blocks)
        above = max(0, view.free_blocks - floor)
        if new_blocks > above:
            available = above + view.reclaimable(tenant.tenant_id, band, pinned_in_use)
            if new_blocks > available:
                return refuse(Decision.REJECTED_WATERMARK, ApiError(
                    503, errors.KV_CACHE_WATERMARK_EXCEEDED,
                    f"the engine's KV cache is nearly full ({view.free_blocks} of "
                    f"{view.total_blocks} blocks free, {floor} kept for guaranteed "
                    f"capacity, {available - above} reclaimable from lower classes) and "
                    f"this request would borrow {new_blocks} blocks beyond tenant "
                    f"{tenant.tenant_id!r}'s {tenant.guaranteed_blocks} guaranteed. "
                    "Retry later.",
                ), borrowing)
    return Verdict(Decision.ADMITTED, max_tokens, blocks, borrowing=borrowing,
                   new_blocks=new_blocks, extra=extra, output_tokens=reserved,
                   remainder=own)
