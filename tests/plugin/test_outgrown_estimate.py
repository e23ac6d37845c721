"""Requests that outgrow their reserved estimate: the victim order treats them like any
other work, and the plugin counts, per tenant, the victims that held more blocks than
the sidecar reserved for them (on the engine in memory, fake_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import FakeClock, FakeEngine
from plugin_policies import engine_policy, tenant, write_policy

from engine_sidecar.contract.names import RESERVED_BLOCKS_ARG, RESERVED_OUTPUT_ARG
from engine_sidecar.contract.stats import TenantEngineStats
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.rules.identity import identity_from_extra_args


def _run(tmp_path: Path, gold_reserved: int,
         gold_output: int | None = None) -> dict[str, TenantEngineStats]:
    """Two 5-block prompts have decoded to 10 blocks each, all of 20: bronze's next
    block takes one from gold, which borrows (no guarantee) and is the victim; the
    sidecar reserved it `gold_reserved` blocks (`gold_output`: of which output tokens,
    when it was told)."""
    path = tmp_path / "policy.json"
    write_policy(path, engine_policy(
        tenant("gold", "premium", guaranteed=0),
        tenant("bronze", "free", guaranteed=100),
    ))
    engine = FakeEngine(20)
    plugin = engine.build_plugin(PluginConfig(policy_path=path, clock=FakeClock()))
    reserved = {RESERVED_BLOCKS_ARG: gold_reserved} | (
        {} if gold_output is None else {RESERVED_OUTPUT_ARG: gold_output})
    gold = engine.add("gold", tenant="gold", prompt_blocks=5, extra_args=reserved)
    bronze = engine.add("bronze", tenant="bronze", priority=2, prompt_blocks=5,
                        arrival_time=1, extra_args={RESERVED_BLOCKS_ARG: 12})
    engine.allocate(gold, 10)
    engine.allocate(bronze, 10)
    plugin.step_starting()
    assert engine.allocate(bronze, 1, on_failure=plugin.reclaim.on_allocation_failure) is None
    assert engine.preempt() is gold
    plugin.step_ended()
    return plugin.snapshot().stats.tenants


def test_a_victim_that_decoded_past_its_estimate_is_counted_as_outgrown(tmp_path: Path):
    stats = _run(tmp_path, gold_reserved=6)  # prompt + a 16-token estimate
    assert stats["gold"].preemptions == {"borrower": 1}
    assert stats["gold"].outgrown_preemptions == 1
    assert stats["bronze"].outgrown_preemptions == 0


def test_a_victim_within_its_reservation_is_not_counted_as_outgrown(tmp_path: Path):
    stats = _run(tmp_path, gold_reserved=12)  # prompt + 100 tokens
    assert stats["gold"].preemptions == {"borrower": 1}
    assert stats["gold"].outgrown_preemptions == 0


def test_a_reservation_taken_at_a_prompt_ceiling_is_judged_at_the_counted_prompt(
    tmp_path: Path,
):
    """Admitted on its prompt's ceiling, gold was reserved 12 blocks at that ceiling, of
    which 16 output tokens: at its 80 counted prompt tokens that is 6 blocks, which it
    outgrew (the bound alone, 12, would hide it)."""
    stats = _run(tmp_path, gold_reserved=12, gold_output=16)
    assert stats["gold"].outgrown_preemptions == 1


@pytest.mark.parametrize("value", ["12", 0, -3, True, 2.5])
def test_a_reserved_block_count_that_is_not_a_positive_integer_is_ignored(value) -> None:
    identity = identity_from_extra_args({"kvq_tenant": "acme", RESERVED_BLOCKS_ARG: value})
    assert identity.tenant == "acme" and identity.reserved_blocks is None


@pytest.mark.parametrize("value", ["16", -1, True, 2.5])
def test_reserved_output_tokens_that_are_not_a_count_are_ignored(value) -> None:
    identity = identity_from_extra_args({"kvq_tenant": "acme", RESERVED_BLOCKS_ARG: 12,
                                         RESERVED_OUTPUT_ARG: value})
    assert identity.reserved_blocks == 12 and identity.reserved_output is None
