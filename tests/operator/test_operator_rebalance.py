"""The demand-driven split as a pure function: its invariants hold for any input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.contract.stats import SidecarStatus
from kvquota.split.rebalance import (
    EngineDemand,
    EngineSplit,
    RebalanceSettings,
    TenantTotals,
    demand_from_status,
    even_split,
    rebalance_pool,
    rebalance_tenant,
)

ENGINES = [f"e{i}" for i in range(8)]


def _idle(engines: list[str] = ENGINES) -> dict[str, EngineDemand]:
    return {e: EngineDemand() for e in engines}


def test_no_demand_keeps_the_even_split() -> None:
    split = rebalance_tenant(800, 1000, _idle())
    assert split == even_split(800, 1000, ENGINES)
    assert all(s == EngineSplit(100, 125) for s in split.values())


def test_guarantee_moves_to_the_engines_with_the_demand_at_a_bounded_rate() -> None:
    demand = _idle() | {"e0": EngineDemand(reserved_blocks=150, inflight=3, queued=6)}
    split = None
    history = []
    for _ in range(30):
        split = rebalance_tenant(800, 1000, demand, split)
        history.append(split["e0"].guaranteed)
    # One round moves an engine by at most half the even share (50 blocks).
    steps = [b - a for a, b in zip([100, *history], history, strict=False)]
    assert max(steps) == 50 and min(steps) >= 0
    # e0 wants 150 reserved + 6 queued x 50 blocks per request = 450; it grows while
    # short by more than the deadband (5 blocks), toward its want plus the margin (20),
    # from engines that want nothing and keep a quarter of their share (25) each. It
    # stops once covered, and stays there: no flapping.
    assert 450 <= history[-1] <= 470
    assert len(set(history[-10:])) == 1
    assert all(split[e].guaranteed >= 25 for e in ENGINES[1:])
    assert sum(s.guaranteed for s in split.values()) == 800
    assert all(s.maximum - s.guaranteed == 25 for s in split.values())


def test_small_differences_do_not_move_the_split() -> None:
    # Within the deadband (5% of the even share, 5 blocks): nothing changes, so a
    # noisy signal does not flap the policy the engines get.
    # Every engine busy, a little unevenly: targets of 98 to 102 blocks.
    demand = {e: EngineDemand(reserved_blocks=60 + 2 * (i % 3), inflight=1)
              for i, e in enumerate(ENGINES)}
    assert rebalance_tenant(800, 1000, demand) == even_split(800, 1000, ENGINES)


def test_a_guarantee_never_drops_below_what_running_work_holds() -> None:
    split = {e: EngineSplit(100, 125) for e in ENGINES}
    split["e0"], split["e1"] = EngineSplit(300, 325), EngineSplit(0, 25)
    split["e2"] = EngineSplit(0, 25)
    # All the demand is now on e1, but e0 still runs 280 blocks.
    demand = _idle() | {"e0": EngineDemand(reserved_blocks=280, inflight=4),
                        "e1": EngineDemand(reserved_blocks=20, inflight=1, queued=40)}
    for _ in range(20):
        split = rebalance_tenant(800, 1000, demand, split)
        assert split["e0"].guaranteed >= 280
    assert split["e1"].guaranteed > 100


def test_ceilings_cap_what_an_engine_guarantees() -> None:
    demand = _idle() | {"e0": EngineDemand(reserved_blocks=100, inflight=1, queued=20)}
    split = None
    for _ in range(20):
        split = rebalance_tenant(800, 1000, demand, split, ceilings={"e0": 160})
    assert split["e0"].guaranteed == 160
    assert sum(s.guaranteed for s in split.values()) == 800


def test_a_changed_pool_restarts_from_the_even_split() -> None:
    skewed = {e: EngineSplit(100, 125) for e in ENGINES}
    skewed["e0"], skewed["e1"] = EngineSplit(150, 175), EngineSplit(50, 75)
    four = ENGINES[:4]
    assert rebalance_tenant(800, 1000, _idle(four), skewed) == even_split(800, 1000, four)
    # The tenant's quota was edited: the old split's totals no longer match.
    assert rebalance_tenant(1600, 2000, _idle(), skewed) == even_split(1600, 2000, ENGINES)


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="guaranteed <= maximum"):
        rebalance_tenant(10, 5, _idle())
    with pytest.raises(ValueError, match="queued must be >= 0"):
        EngineDemand(queued=-1)
    with pytest.raises(ValueError, match="step_fraction"):
        RebalanceSettings(step_fraction=0)


def test_pool_rebalance_never_guarantees_more_than_an_engine_has() -> None:
    tenants = [TenantTotals("acme", 8 * 600, 8 * 750, priority=0),
               TenantTotals("hobby", 8 * 50, 8 * 400, priority=2)]
    demand = {"acme": {"e0": EngineDemand(reserved_blocks=700, inflight=10, queued=30)},
              "hobby": {"e0": EngineDemand(reserved_blocks=300, inflight=10, queued=30)}}
    splits = None
    for _ in range(30):
        splits = rebalance_pool(tenants, demand, splits, engines=ENGINES,
                                guaranteeable_per_engine=850)
        for engine in ENGINES:
            assert sum(s[engine].guaranteed for s in splits.values()) <= 850
    # acme (first in priority order) took e0's room up to what hobby's guarantee there
    # leaves: the engine guarantees all it can, and no more.
    e0 = splits["acme"]["e0"].guaranteed + splits["hobby"]["e0"].guaranteed
    assert e0 == 850 and splits["acme"]["e0"].guaranteed > 700
    assert sum(s.guaranteed for s in splits["acme"].values()) == 8 * 600


demands = st.builds(
    EngineDemand,
    reserved_blocks=st.integers(0, 2000), inflight=st.integers(0, 40),
    queued=st.integers(0, 60), refused=st.integers(0, 60),
    leased_blocks=st.integers(0, 1000), used_blocks=st.integers(0, 2000),
)


@settings(max_examples=300, deadline=None)
@given(
    engines=st.integers(1, 12),
    guaranteed=st.integers(0, 20_000),
    headroom=st.integers(0, 10_000),
    rounds=st.lists(st.lists(demands, min_size=12, max_size=12), min_size=1, max_size=6),
    ceiling=st.one_of(st.none(), st.integers(0, 5000)),
    step=st.floats(0.01, 1.0),
    deadband=st.floats(0.0, 0.5),
)
def test_invariants_hold_for_any_demand(
    engines: int, guaranteed: int, headroom: int, rounds: list[list[EngineDemand]],
    ceiling: int | None, step: float, deadband: float,
) -> None:
    names = [f"engine-{i}" for i in range(engines)]
    maximum = guaranteed + headroom
    knobs = RebalanceSettings(step_fraction=step, deadband_fraction=deadband)
    even = even_split(guaranteed, maximum, names)
    share = even[names[0]]
    limit = max(1, -(-share.guaranteed * step // 1))  # ceil(step x even share), >= 1
    split = even
    for round_demand in rounds:
        demand = dict(zip(names, round_demand, strict=False))
        ceilings = dict.fromkeys(names, ceiling) if ceiling is not None else None
        new = rebalance_tenant(guaranteed, maximum, demand, split, ceilings=ceilings,
                               settings=knobs)
        assert sorted(new) == sorted(names)
        # Totals invariant.
        assert sum(s.guaranteed for s in new.values()) == share.guaranteed * engines
        assert sum(s.maximum for s in new.values()) == share.maximum * engines
        for name in names:
            old, now = split[name], new[name]
            assert now.guaranteed >= 0 and now.maximum >= now.guaranteed
            # Bounded rate.
            assert abs(now.guaranteed - old.guaranteed) <= limit
            # Held work (running and leased) keeps its room.
            held = demand[name].held_blocks
            assert now.guaranteed >= min(held, old.guaranteed)
            assert now.maximum >= min(held, old.maximum)
            # An engine grows only up to its ceiling.
            if ceiling is not None and now.guaranteed > old.guaranteed:
                assert now.guaranteed <= ceiling
        # Deterministic.
        assert new == rebalance_tenant(guaranteed, maximum, demand, split,
                                       ceilings=ceilings, settings=knobs)
        split = new


def test_a_router_that_spreads_the_tenant_moves_nothing_however_noisy() -> None:
    # A least-KV router at 64 engines: every engine holds 30-70% of its even share and
    # admits a Poisson-noisy number of requests a round; none is short. The split stays
    # even (the traffic-weighted design moved most engines every round here, taking
    # guarantee from the engines the router sent the next requests to).
    rng = random.Random(7)
    engines = [f"engine-{i:02d}" for i in range(64)]
    even = even_split(64 * 900, 64 * 1200, engines)
    split = even
    for _ in range(20):
        demand = {e: EngineDemand(reserved_blocks=rng.randint(270, 630), inflight=3,
                                  admitted=rng.choice([0, 0, 1, 1, 2, 3, 5]))
                  for e in engines}
        split = rebalance_tenant(64 * 900, 64 * 1200, demand, split)
        assert split == even


def test_a_shortage_is_covered_in_bounded_rounds_and_then_nothing_moves() -> None:
    demand = _idle() | {"e0": EngineDemand(reserved_blocks=180, inflight=3, queued=4),
                        "e1": EngineDemand(reserved_blocks=60, inflight=1)}
    split = None
    changes = 0
    for _ in range(20):
        new = rebalance_tenant(800, 1000, demand, split)
        changes += new != split
        split = new
    # e0 wants 180 + 4 x 60 = 420: 320 past its 100, at most 50 a round: 7 rounds (the
    # first from no split at all counts as one), then the split stands still, e0 within
    # its want plus the margin (the deadband, 5, and a fifth of its want, 84).
    assert changes <= 8
    assert 420 <= split["e0"].guaranteed <= 420 + 5 + 84
    assert split["e1"].guaranteed >= 60  # what e1 holds stays guaranteed
    assert sum(s.guaranteed for s in split.values()) == 800


def _status(admitted: int, quota: int, watermark: int, reserved: int = 0,
            queued: int = 0) -> SidecarStatus:
    return SidecarStatus.model_validate({"ready": True, "tenants": {"acme": {
        "usage": {"reservedBlocks": reserved, "inflight": 2, "queued": queued},
        "counters": {"admitted": admitted, "rejectedQuota": quota,
                     "rejectedWatermark": watermark},
    }}})


def test_demand_is_read_from_two_polls_of_the_sidecar_status() -> None:
    first, second = _status(10, 1, 0), _status(25, 3, 2, reserved=120, queued=4)
    assert demand_from_status(second, first) == {"acme": EngineDemand(
        reserved_blocks=120, inflight=2, queued=4, refused=4, admitted=15)}
    # A restarted sidecar counts from zero again: all it counted is new.
    assert demand_from_status(_status(5, 0, 1), second)["acme"] == EngineDemand(
        inflight=2, refused=1, admitted=5)
    assert demand_from_status(first)["acme"].admitted == 10
