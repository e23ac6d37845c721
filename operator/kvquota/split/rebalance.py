"""Demand-driven split of a tenant's pool-wide quota across engines (pure, deterministic).

A prefix- or session-affine router lands a tenant's load on a few engines, where the
even split refuses it while its guarantee idles elsewhere. `rebalance_tenant` moves
the tenant's per-engine guarantee toward the engines where its demand is, from what
each sidecar reports: totals stay those of the even split, guarantee moves only for a
shortage (hysteresis) and at most `step` blocks per round, never below what admitted
work holds, never beyond an engine's room. Same input, same split. The rules and why:
docs/operator.md, "The demand-driven split".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine_sidecar.contract.stats import SidecarStatus
from kvquota.split.capacity import split_quota


@dataclass(frozen=True)
class EngineDemand:
    """One tenant on one engine, as its sidecar's status reports it."""

    reserved_blocks: int = 0  # usage.reservedBlocks: admitted requests' reservations
    inflight: int = 0
    queued: int = 0
    refused: int = 0  # refusals (quota or watermark) since the previous round
    admitted: int = 0  # requests admitted since the previous round (not moved by)
    leased_blocks: int = 0  # usage.leasedBlocks: pinned by leases, no running request's
    used_blocks: int = 0  # usage.blocks: what the engine holds, running and leased

    def __post_init__(self) -> None:
        for name in ("reserved_blocks", "inflight", "queued", "refused", "admitted",
                     "leased_blocks", "used_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineDemand.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def held_blocks(self) -> int:
        """What the tenant holds on the engine as admission counts it against the
        engine's quota (`admission.PoolView.holding`): its running work (its
        reservations, or the blocks the engine holds for it where more) and the blocks
        only its leases pin. A guarantee below this makes held work borrowed."""
        return max(self.used_blocks, self.reserved_blocks + self.leased_blocks)


def demand_from_status(
    status: SidecarStatus, previous: SidecarStatus | None = None
) -> dict[str, EngineDemand]:
    """Each tenant's demand on one engine from two successive polls of its sidecar: the
    usage as it is now, the admissions and refusals counted since `previous` (None, or
    counters that went down, a restarted sidecar: everything counted so far). The
    status counts concurrency refusals with quota refusals; both count here."""
    out = {}
    for tenant_id, now in status.tenants.items():
        before = previous.tenants.get(tenant_id) if previous is not None else None
        counters = now.counters
        admitted = counters.admitted
        refused = counters.rejected_quota + counters.rejected_watermark
        if before is not None:
            old = before.counters
            old_refused = old.rejected_quota + old.rejected_watermark
            if old.admitted <= admitted and old_refused <= refused:
                admitted, refused = admitted - old.admitted, refused - old_refused
        out[tenant_id] = EngineDemand(
            reserved_blocks=now.usage.reserved_blocks, inflight=now.usage.inflight,
            queued=now.usage.queued, refused=refused, admitted=admitted,
            leased_blocks=now.usage.leased_blocks, used_blocks=now.usage.blocks,
        )
    return out


@dataclass(frozen=True)
class EngineSplit:
    guaranteed: int
    maximum: int


@dataclass(frozen=True)
class RebalanceSettings:
    """Fractions of the even per-engine guarantee."""

    step_fraction: float = 0.5  # the most an engine moves a round
    deadband_fraction: float = 0.05  # shortages and surpluses up to this are ignored
    margin_fraction: float = 0.2  # of an engine's own want: room above it it is given

    def __post_init__(self) -> None:
        if not 0 < self.step_fraction <= 1:
            raise ValueError(f"step_fraction must be in (0, 1], got {self.step_fraction}")
        for name in ("deadband_fraction", "margin_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def even_split(guaranteed: int, maximum: int, engines: Sequence[str]) -> dict[str, EngineSplit]:
    """The same share on every engine (the split a rebalance starts from)."""
    share = split_quota(guaranteed, maximum, len(engines))
    return {engine: EngineSplit(share.guaranteed, share.maximum) for engine in engines}


def apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split in proportion to `weights` (>= 0), by largest remainder; ties go to
    the engine named first. All zero weights: an even split."""
    names = sorted(weights)
    if not names:
        return {}
    if any(w < 0 or not math.isfinite(w) for w in weights.values()):
        raise ValueError(f"weights must be finite and >= 0, got {dict(weights)}")
    weight_sum = sum(weights.values())
    if weight_sum <= 0:
        weights = {name: 1.0 for name in names}
        weight_sum = float(len(names))
    exact = {name: total * weights[name] / weight_sum for name in names}
    out = {name: math.floor(exact[name]) for name in names}
    left = total - sum(out.values())
    by_remainder = sorted(names, key=lambda n: (-(exact[n] - out[n]), n))
    for name in by_remainder[:left]:
        out[name] += 1
    return out


def demand_blocks(demand: Mapping[str, EngineDemand], even_guaranteed: int) -> dict[str, int]:
    """Blocks each engine's work wants (see the module docstring)."""
    reserved = sum(d.reserved_blocks for d in demand.values())
    inflight = sum(d.inflight for d in demand.values())
    per_request = reserved / inflight if inflight else float(max(even_guaranteed, 1))
    return {
        engine: d.held_blocks + math.ceil(per_request * (d.queued + d.refused))
        for engine, d in demand.items()
    }


def _scale(moves: dict[str, int], amount: int) -> dict[str, int]:
    """Shrink `moves` (all the same sign) so their magnitudes add up to `amount`."""
    size = sum(abs(m) for m in moves.values())
    if size <= amount:
        return moves
    sign = 1 if sum(moves.values()) > 0 else -1
    # Each share is at most ceil(amount * |m| / size) <= |m|: no engine moves further
    # than it asked to.
    scaled = apportion(amount, {e: float(abs(m)) for e, m in moves.items()})
    return {e: sign * scaled[e] for e in moves}


def rebalance_tenant(
    guaranteed: int,
    maximum: int,
    demand: Mapping[str, EngineDemand],
    previous: Mapping[str, EngineSplit] | None = None,
    *,
    ceilings: Mapping[str, int] | None = None,
    settings: RebalanceSettings = RebalanceSettings(),
) -> dict[str, EngineSplit]:
    """The next per-engine split of a tenant with pool-wide `guaranteed`/`maximum`
    blocks, from each engine's `demand` and the split in force (`previous`; None, or
    one for another set of engines or other totals: start from the even split)."""
    if guaranteed < 0 or maximum < guaranteed:
        raise ValueError(f"need 0 <= guaranteed <= maximum, got {guaranteed} and {maximum}")
    engines = sorted(demand)
    if not engines:
        return {}
    even = even_split(guaranteed, maximum, engines)
    share = even[engines[0]]
    headroom = share.maximum - share.guaranteed
    total = share.guaranteed * len(engines)
    current = dict(previous) if previous is not None else {}
    if (sorted(current) != engines
            or sum(s.guaranteed for s in current.values()) != total
            or any(s.maximum - s.guaranteed != headroom for s in current.values())):
        current = even
    ceilings = ceilings or {}
    wants = demand_blocks(demand, share.guaranteed)
    step = max(1, math.ceil(settings.step_fraction * share.guaranteed))
    deadband = math.floor(settings.deadband_fraction * share.guaranteed)
    gains: dict[str, int] = {}
    losses: dict[str, int] = {}
    for engine in engines:
        now = current[engine].guaranteed
        want = wants[engine]
        # Given when short, kept when giving: room to grow before it is short again.
        # Want >= held, so held work keeps its room.
        keep = want + deadband + math.ceil(settings.margin_fraction * want)
        if want > now + deadband:  # short: its work borrows, waits or is refused
            room = ceilings.get(engine)
            gain = min(step, keep - now, max(0, room - now) if room is not None else step)
            if gain > 0:
                gains[engine] = gain
        elif now - keep > deadband:
            losses[engine] = -min(step, now - keep)
    amount = min(sum(gains.values()), -sum(losses.values()))
    moves = {**_scale(gains, amount), **_scale(losses, amount)} if amount else {}
    out = {}
    for engine in engines:
        g = current[engine].guaranteed + moves.get(engine, 0)
        out[engine] = EngineSplit(g, g + headroom)
    return out


@dataclass(frozen=True)
class TenantTotals:
    tenant_id: str
    guaranteed: int
    maximum: int
    priority: int = 1  # rebalanced in this order (lower first), then by id


def rebalance_pool(
    tenants: Sequence[TenantTotals],
    demand: Mapping[str, Mapping[str, EngineDemand]],
    previous: Mapping[str, Mapping[str, EngineSplit]] | None,
    *,
    engines: Sequence[str],
    guaranteeable_per_engine: int,
    settings: RebalanceSettings = RebalanceSettings(),
) -> dict[str, dict[str, EngineSplit]]:
    """Every tenant's next split (`demand[tenant][engine]`, missing: no demand). Tenants
    go in priority order; each may grow on an engine only into the room the others'
    guarantees (new ones where decided, the current ones otherwise) leave there."""
    previous = previous or {}
    splits: dict[str, dict[str, EngineSplit]] = {}
    for tenant in tenants:
        current = previous.get(tenant.tenant_id)
        if current is None or sorted(current) != sorted(engines):
            current = even_split(tenant.guaranteed, tenant.maximum, engines)
        splits[tenant.tenant_id] = dict(current)
    for tenant in sorted(tenants, key=lambda t: (t.priority, t.tenant_id)):
        ceilings = {
            engine: guaranteeable_per_engine - sum(
                split[engine].guaranteed for tid, split in splits.items()
                if tid != tenant.tenant_id
            )
            for engine in engines
        }
        tenant_demand = demand.get(tenant.tenant_id, {})
        per_engine = {engine: tenant_demand.get(engine, EngineDemand()) for engine in engines}
        splits[tenant.tenant_id] = rebalance_tenant(
            tenant.guaranteed, tenant.maximum, per_engine, splits[tenant.tenant_id],
            ceilings=ceilings, settings=settings,
        )
    return splits
