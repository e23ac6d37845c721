"""Requests that outgrow their reserved estimate, on vLLM's real Scheduler: the
victim order treats them like any other work, and the plugin counts, per tenant, the
victims that held more blocks than the sidecar reserved for them."""

from __future__ import annotations

import pytest
from plugin_policies import engine_policy, tenant, write_policy

from engine_sidecar.contract.names import RESERVED_BLOCKS_ARG, RESERVED_OUTPUT_ARG
from engine_sidecar.plugin.rules.identity import identity_from_extra_args

BLOCK = 16


def _run(make_harness, policy_path, tokens, gold_reserved: int, gold_output: int | None = None):
    """Two 5-block prompts decode 100 tokens each (12 blocks at the end) into 20
    blocks: one must give way, at about 10 blocks each. Gold borrows (no guarantee), so
    it is the victim; the sidecar reserved it `gold_reserved` blocks (`gold_output`: of
    which output tokens, when it was told)."""
    write_policy(policy_path, engine_policy(
        tenant("gold", "premium", guaranteed=0),
        tenant("bronze", "free", guaranteed=100),
    ))
    harness = make_harness(num_blocks=21, block_size=BLOCK, policy_path=policy_path)
    harness.add_request("gold", tokens(80), 100, priority=0, tenant="gold",
                        extra_args={RESERVED_BLOCKS_ARG: gold_reserved} | (
                            {} if gold_output is None else {RESERVED_OUTPUT_ARG: gold_output}))
    harness.add_request("bronze", tokens(80), 100, priority=2, tenant="bronze",
                        extra_args={RESERVED_BLOCKS_ARG: 12})
    harness.run_until_done()
    assert harness.requests["gold"].num_preemptions >= 1
    assert harness.requests["bronze"].num_preemptions == 0
    return harness.kvq_stats().tenants


def test_a_victim_that_decoded_past_its_estimate_is_counted_as_outgrown(
    make_harness, policy_path, tokens
):
    stats = _run(make_harness, policy_path, tokens, gold_reserved=6)  # prompt + a 16-token estimate
    gold = stats["gold"]
    assert gold.outgrown_preemptions >= 1
    assert gold.outgrown_preemptions <= sum(gold.preemptions.values())
    assert stats["bronze"].outgrown_preemptions == 0


def test_a_victim_within_its_reservation_is_not_counted_as_outgrown(
    make_harness, policy_path, tokens
):
    stats = _run(make_harness, policy_path, tokens, gold_reserved=12)  # prompt + 100 tokens
    assert sum(stats["gold"].preemptions.values()) >= 1
    assert stats["gold"].outgrown_preemptions == 0


def test_a_reservation_taken_at_a_prompt_ceiling_is_judged_at_the_counted_prompt(
    make_harness, policy_path, tokens
):
    """Admitted on its prompt's ceiling, gold was reserved 12 blocks at that ceiling, of
    which 16 output tokens: at its 80 counted prompt tokens that is 6 blocks, which it
    outgrew (the bound alone, 12, would hide it)."""
    stats = _run(make_harness, policy_path, tokens, gold_reserved=12, gold_output=16)
    assert stats["gold"].outgrown_preemptions >= 1


@pytest.mark.parametrize("value", ["12", 0, -3, True, 2.5])
def test_a_reserved_block_count_that_is_not_a_positive_integer_is_ignored(value) -> None:
    identity = identity_from_extra_args({"kvq_tenant": "acme", RESERVED_BLOCKS_ARG: value})
    assert identity.tenant == "acme" and identity.reserved_blocks is None


@pytest.mark.parametrize("value", ["16", -1, True, 2.5])
def test_reserved_output_tokens_that_are_not_a_count_are_ignored(value) -> None:
    identity = identity_from_extra_args({"kvq_tenant": "acme", RESERVED_BLOCKS_ARG: 12,
                                         RESERVED_OUTPUT_ARG: value})
    assert identity.reserved_blocks == 12 and identity.reserved_output is None
