"""The demand-driven split as the operator renders it (pure): the per-engine entries of
the policy, which tenants get one, and a poll round of one pool."""

from __future__ import annotations

import json

import pytest
from operator_objects import pool

from engine_sidecar.contract.policy import EnginePolicy, EngineShare, TenantPolicy, Tier
from engine_sidecar.contract.stats import SidecarStatus, TenantCounters, TenantStatus, TenantUsage
from kvquota.api import InferencePoolSpec
from kvquota.policy.render import compose_policy, render_tenant
from kvquota.split.demand import PoolSplit, SplitInputs, engine_overrides
from kvquota.split.rebalance import EngineSplit, TenantTotals

SPEC = InferencePoolSpec.model_validate(pool()["spec"])


def _tenant(tenant_id: str, guaranteed: int = 100, maximum: int = 150) -> TenantPolicy:
    return TenantPolicy(tenant_id=tenant_id, tier=Tier.STANDARD, priority=1,
                        guaranteed_blocks=guaranteed, max_blocks_per_engine=maximum,
                        max_tokens=512, default_max_tokens=256)


def _share(guaranteed: int, maximum: int) -> EngineShare:
    return EngineShare(guaranteed_blocks=guaranteed, max_blocks_per_engine=maximum)


def test_per_engine_entries_are_part_of_the_versioned_text_and_absent_when_even() -> None:
    tenants = [render_tenant(_tenant("acme")), render_tenant(_tenant("zeta"))]
    even = compose_policy("ns", "p", SPEC, tenants, replicas=2)
    assert "engines" not in json.loads(even.text)  # older sidecars read it as before
    overrides = {"engine-b": {"acme": _share(60, 110)}, "engine-a": {"acme": _share(140, 190)}}
    split = compose_policy("ns", "p", SPEC, tenants, replicas=2, engines=overrides)
    whole = EnginePolicy.model_validate(
        {**split.policy.model_dump(), "version": ""}).with_version()
    assert split.policy.version == whole.version != even.policy.version
    assert split.text == whole.to_json()
    assert list(json.loads(split.text)["engines"]) == ["engine-a", "engine-b"]  # sorted
    assert EnginePolicy.from_json(split.text) == split.policy
    again = compose_policy("ns", "p", SPEC, tenants[::-1], replicas=2,
                           engines=dict(reversed(overrides.items())))
    assert again.text == split.text  # deterministic whatever the input order


def test_an_entry_for_a_tenant_not_in_the_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="not in the policy"):
        compose_policy("ns", "p", SPEC, [render_tenant(_tenant("acme"))], replicas=2,
                       engines={"engine-a": {"ghost": _share(1, 1)}})
    body = json.loads(compose_policy("ns", "p", SPEC, [], replicas=2).text)
    with pytest.raises(ValueError, match="names tenants not in the policy: ghost"):
        EnginePolicy.model_validate(
            {**body, "version": "", "engines": {"e": {"ghost": {"guaranteedBlocks": 1,
                                                               "maxBlocks": 1}}}})
    with pytest.raises(ValueError, match="maxBlocks"):
        _share(5, 4)


def test_only_tenants_moved_off_the_even_split_get_entries() -> None:
    tenants = {"acme": _tenant("acme"), "even": _tenant("even"), "stale": _tenant("stale")}
    splits = {
        "acme": {"a": EngineSplit(150, 200), "b": EngineSplit(50, 100)},
        "even": {"a": EngineSplit(100, 150), "b": EngineSplit(100, 150)},
        # Computed before the quota changed (it no longer adds up): even until next round.
        "stale": {"a": EngineSplit(180, 230), "b": EngineSplit(80, 130)},
    }
    # b's guarantee moved to a; its ceiling stays the even one (150), not 100.
    assert engine_overrides(tenants, splits, replicas=2) == {
        "a": {"acme": _share(150, 200)}, "b": {"acme": _share(50, 150)}}
    assert engine_overrides(tenants, splits, replicas=3) == {}  # another engine count


def _report(reserved: int = 0, queued: int = 0, admitted: int = 0,
            refused: int = 0) -> SidecarStatus:
    return SidecarStatus(ready=True, total_blocks=1000, tenants={"acme": TenantStatus(
        usage=TenantUsage(reserved_blocks=reserved, inflight=max(reserved // 20, 0),
                          queued=queued),
        counters=TenantCounters(admitted=admitted, rejected_quota=refused))})


def test_a_poll_round_moves_the_guarantee_toward_demand_within_a_bounded_step() -> None:
    inputs = SplitInputs([TenantTotals("acme", 400, 600, 0)], capacity_per_engine=1000,
                         watermark=0.15)
    state, twin = PoolSplit(), PoolSplit()
    rounds = []
    for step in range(4):
        reports = {"engine-a": _report(reserved=190, queued=20, admitted=10 * step,
                                       refused=2 * step),
                   "engine-b": _report()}
        state.poll_round(inputs, ["engine-b", "engine-a"], reports)
        twin.poll_round(inputs, ["engine-a", "engine-b"], reports)
        assert twin.splits == state.splits  # deterministic
        split = state.splits["acme"]
        assert split["engine-a"].guaranteed + split["engine-b"].guaranteed == 400
        assert all(s.maximum - s.guaranteed == 100 for s in split.values())
        rounds.append(split["engine-a"].guaranteed)
    # Half an even share per round, until engine-b, which wants nothing, keeps only its
    # deadband (5% of its share, 10); then it stays.
    assert rounds == [300, 390, 390, 390]

    state.poll_round(inputs, ["engine-a"], {"engine-a": _report()})
    assert state.splits == {}  # one engine: nothing to split
    state.poll_round(SplitInputs(inputs.tenants, None, 0.15), ["a", "b"], {})
    assert state.splits == {}  # capacity unknown


def _holding(reserved: int, running: int, leased: int, inflight: int = 0) -> SidecarStatus:
    """One engine's report of acme holding blocks: `running` of its running requests
    (the plugin's), `leased` only its leases pin, `reserved` by admission."""
    return SidecarStatus(ready=True, total_blocks=1000, tenants={"acme": TenantStatus(
        usage=TenantUsage(blocks=running + leased, reserved_blocks=reserved,
                          leased_blocks=leased, inflight=inflight))})


@pytest.mark.parametrize(("reserved", "running", "leased", "held"), [
    (0, 0, 180, 180),  # idle sessions' leases, nothing in flight
    (100, 120, 70, 190),  # a follow-up runs on its leased prefix (held past reserved)
    (150, 40, 30, 180),  # reservations still growing, beside another session's lease
])
def test_a_poll_round_never_takes_what_an_engines_work_and_leases_hold(
    reserved: int, running: int, leased: int, held: int,
) -> None:
    # engine-a is short (40 queued); engine-b holds `held` blocks of acme as its
    # admission counts them (running work or reservations, plus lease-only blocks).
    inputs = SplitInputs([TenantTotals("acme", 1000, 1200, 0)], capacity_per_engine=2000,
                         watermark=0.15)
    state = PoolSplit()
    for _ in range(6):
        state.poll_round(inputs, ["engine-a", "engine-b"], {
            "engine-a": _report(reserved=200, queued=40),
            "engine-b": _holding(reserved, running, leased, inflight=reserved // 50)})
        split = state.splits["acme"]
        assert split["engine-b"].guaranteed >= held  # what b holds stays guaranteed
        assert split["engine-a"].guaranteed + split["engine-b"].guaranteed == 1000
    # b gave a all it had past what it holds and its margin (the deadband, 25, and a
    # fifth of what it holds), give or take a deadband.
    assert held <= split["engine-b"].guaranteed <= held + 25 + -(-held // 5) + 25
