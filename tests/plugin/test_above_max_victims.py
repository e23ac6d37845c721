"""Work a tenant runs beyond its maxBlocks (aboveMax: Reclaimable) is the first victim,
in vLLM's real scheduler: before a lower tier's work, and never at the expense of a
tenant within its guarantee."""

from __future__ import annotations

import pytest
from plugin_policies import engine_policy, tenant, write_policy

from engine_sidecar.contract.names import ABOVE_MAX_ARG

BLOCK = 16
BEYOND = {ABOVE_MAX_ARG: True}  # what the sidecar sends with work it admitted beyond maxBlocks


def _preempted(harness) -> list[str]:
    order: list[str] = []
    for step in harness.steps:
        order.extend(r for r in step.preempted_req_ids if r not in order)
    return order


@pytest.mark.parametrize(("above_max", "first_victim"), [
    ("Reclaimable", "gold"),  # premium beyond its ceiling gives way first
    ("Never", "bronze"),  # two borrowers: the lower tier first
])
def test_work_beyond_max_blocks_goes_before_a_lower_tiers_borrowing(
    make_harness, policy_path, tokens, above_max, first_victim
):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", max_blocks=5, above_max=above_max),
        tenant("bronze", "free"),
    ))
    # 10-block prompts decoding 60 tokens each into 20 blocks: one must give way.
    harness = make_harness(num_blocks=21, block_size=BLOCK, policy_path=policy_path)
    harness.add_request("gold", tokens(160), 60, priority=0, tenant="gold", extra_args=BEYOND)
    harness.add_request("bronze", tokens(160), 60, priority=2, tenant="bronze")
    harness.run_until_done()

    assert _preempted(harness)[0] == first_victim
    if above_max == "Reclaimable":
        assert harness.kvq_stats().tenants["gold"].preemptions["above_max"] >= 1


def test_a_tenant_within_its_guarantee_is_never_preempted_for_work_beyond_max_blocks(
    make_harness, policy_path, tokens
):
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", max_blocks=5),
        tenant("bronze", "free", guaranteed=100),
    ))
    harness = make_harness(num_blocks=41, block_size=BLOCK, policy_path=policy_path)
    for i in range(2):  # bronze: 2 x (10 + 4) blocks, within its 100
        harness.add_request(f"bronze-{i}", tokens(160), 60, priority=2, tenant="bronze")
    for i in range(3):  # gold: all of it admitted beyond its 5
        harness.add_request(f"gold-{i}", tokens(160), 60, priority=0, tenant="gold",
                            extra_args=BEYOND)
    harness.run_until_done()

    preempted = _preempted(harness)
    assert preempted, "no memory pressure: the test shows nothing"
    assert all(r.startswith("gold") for r in preempted), preempted
    for i in range(2):
        assert harness.requests[f"bronze-{i}"].num_preemptions == 0


def test_only_work_admitted_beyond_max_blocks_ranks_first(make_harness, policy_path, tokens):
    # The same premium request, not flagged by the sidecar: ordinary borrowing (its
    # leases and its work within the ceiling are never above-max work).
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", max_blocks=5),
        tenant("bronze", "free"),
    ))
    harness = make_harness(num_blocks=21, block_size=BLOCK, policy_path=policy_path)
    harness.add_request("gold", tokens(160), 60, priority=0, tenant="gold")
    harness.add_request("bronze", tokens(160), 60, priority=2, tenant="bronze")
    harness.run_until_done()

    assert _preempted(harness)[0] == "bronze"
