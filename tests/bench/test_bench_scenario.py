"""Scenario files: what users write, what the loader tells them when it is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine_sidecar.contract.policy import Tier
from kvquota_lab.bench.scenario import (
    ScenarioError,
    generate_sessions,
    load_scenario,
    parse_scenario,
    scenario_scales,
    shipped_scenarios,
)

SHIPPED = ("noisy-neighbour", "premium-idle-burst", "all-premium-saturation", "steady-mixed")


def test_the_documented_scenarios_ship_with_small_and_engine_scales() -> None:
    assert set(SHIPPED) <= set(shipped_scenarios())
    for name in SHIPPED:
        assert {"small", "engine"} <= set(scenario_scales(name))
        for scale in (None, "small", "engine"):
            scenario = load_scenario(name, scale=scale)
            assert generate_sessions(scenario), (name, scale)
        engine = load_scenario(name, scale="engine").engine
        assert engine.block_size % 32 == 0  # vLLM's CPU attention needs it


def test_noisy_neighbour_is_at_realistic_scale() -> None:
    scenario = load_scenario("noisy-neighbour")
    sessions = generate_sessions(scenario)
    assert scenario.engine.capacity_blocks >= 20_000
    assert sum(len(s.turns) for s in sessions) >= 2_000


def test_same_seed_same_requests_and_a_new_seed_changes_them() -> None:
    first = generate_sessions(load_scenario("noisy-neighbour", scale="small"))
    again = generate_sessions(load_scenario("noisy-neighbour", scale="small"))
    other = generate_sessions(load_scenario("noisy-neighbour", scale="small", seed=99))
    assert first == again
    assert [s.first_prompt() for s in first[:5]] == [s.first_prompt() for s in again[:5]]
    assert first != other


def test_the_baseline_keeps_the_premium_sessions_exactly() -> None:
    scenario = load_scenario("noisy-neighbour", scale="small")
    premium = [s for s in generate_sessions(scenario) if s.tier is Tier.PREMIUM]
    quiet = generate_sessions(scenario.without_tiers([Tier.FREE]))
    assert quiet == premium


def test_quotas_render_into_the_policy_production_applies(tiny_scenario: Path) -> None:
    policy = load_scenario(str(tiny_scenario)).engine_policy()
    acme, free = policy.tenants["acme"], policy.tenants["hobbyist"]
    assert (acme.guaranteed_blocks, acme.max_blocks_per_engine) == (400, 560)  # 50% / 70% of 800
    assert acme.lease.max_leased_blocks == 240
    assert acme.priority == 0 and acme.lease.seconds == 300  # premium tier defaults
    assert free.priority == 2 and free.lease.seconds == 0
    assert free.max_concurrent_requests == 8
    assert policy.version == policy.content_hash()


def _error(text: str, **kwargs: object) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, source="my.yaml", **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def _tiny_with(tiny_scenario: Path, change: dict[str, object]) -> str:
    data = yaml.safe_load(tiny_scenario.read_text())
    acme = data["tenants"]["acme"]
    for key, value in change.items():
        target = acme
        *path, last = key.split(".")
        for part in path:
            target = target[part]
        target[last] = value
    return yaml.safe_dump(data)


def test_a_misspelt_field_is_named_with_its_path(tiny_scenario: Path) -> None:
    text = _tiny_with(tiny_scenario, {"workloads.chat.promptToken": 100})
    message = _error(text)
    assert message.startswith("invalid scenario my.yaml:")
    assert "tenants.acme.workloads.chat.promptToken" in message
    assert "Extra inputs are not permitted" in message


def test_a_distribution_missing_a_parameter_says_which(tiny_scenario: Path) -> None:
    text = _tiny_with(tiny_scenario, {"workloads.chat.promptTokens": {"dist": "lognormal",
                                                                      "median": 500}})
    message = _error(text)
    assert "tenants.acme.workloads.chat.promptTokens.lognormal.sigma" in message
    assert "Field required" in message


def test_guarantees_that_cannot_fit_are_refused_with_the_numbers(tiny_scenario: Path) -> None:
    text = _tiny_with(tiny_scenario, {"kvCache.guaranteedBlocks": "90%",
                                      "kvCache.maxBlocks": "95%"})
    message = _error(text)
    assert "guaranteedBlocks add up to 760" in message
    assert "680" in message  # 800 x (1 - 0.15)


def test_a_bad_percentage_and_a_max_below_the_guarantee(tiny_scenario: Path) -> None:
    assert "percentage of engine.capacityBlocks" in _error(
        _tiny_with(tiny_scenario, {"kvCache.maxBlocks": "lots"})
    )
    assert "maxBlocks (80) must be >= guaranteedBlocks (400)" in _error(
        _tiny_with(tiny_scenario, {"kvCache.maxBlocks": 80})
    )


def test_unknown_names_list_what_exists(tiny_scenario: Path) -> None:
    with pytest.raises(ScenarioError, match=r"shipped: .*noisy-neighbour"):
        load_scenario("noisy-neighbor")
    scales = r"no scale 'huge' \(scales: a100-40gb, engine, small\)"
    with pytest.raises(ScenarioError, match=scales):
        load_scenario("noisy-neighbour", scale="huge")
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(str(tiny_scenario.parent / "missing.yaml"))
    assert "not valid YAML" in _error("name: [unclosed")


def test_scale_overrides_replace_distributions_whole() -> None:
    scenario = load_scenario("noisy-neighbour", scale="engine")
    chat = scenario.tenants["acme"].workloads["chat"]
    # The engine scale gives a uniform where the full scenario has a lognormal.
    assert chat.prompt_tokens.dist == "uniform"
    assert scenario.engine.capacity_blocks == 640


@pytest.mark.parametrize("name", ["generous-three-tier", "generous-premium-burst"])
def test_generous_scenarios_ask_for_far_more_than_they_answer(name: str) -> None:
    """Clients send max_tokens 4096 for short prompts; answers are a few hundred tokens
    with a long tail, so the answer length is not max_tokens."""
    import statistics

    scenario = load_scenario(name)
    sessions = generate_sessions(scenario)
    assert {s.max_tokens for s in sessions} == {4096}
    assert len({s.tier for s in sessions}) == 3
    first = [s.turns[0].new_tokens for s in sessions]
    outputs = [t.output_tokens for s in sessions for t in s.turns]
    assert 500 <= statistics.median(first) <= 800
    assert 200 <= statistics.median(outputs) <= 300
    assert sorted(outputs)[int(len(outputs) * 0.99)] >= 3 * statistics.median(outputs)
    assert {"small", "a100-40gb"} <= set(scenario_scales(name))


def test_the_premium_burst_scenario_bursts_premium_itself() -> None:
    scenario = load_scenario("generous-premium-burst")
    premium = [t for t in scenario.tenants.values() if t.tier is Tier.PREMIUM]
    assert len(premium) == 1
    assert any(w.arrival.process == "bursts" for w in premium[0].workloads.values())


def test_the_engine_scale_reserving_max_tokens_would_exceed_premium_max_blocks() -> None:
    """On the CPU engine, a few premium requests reserving max_tokens fill premium's
    maxBlocks, while a dozen typical ones hold less than it with their real answers."""
    import math

    from kvquota_lab.bench.scenario import resolve_blocks

    scenario = load_scenario("generous-premium-burst", scale="engine")
    engine = scenario.engine
    assert engine.block_size % 32 == 0
    acme = scenario.tenants["acme"]
    max_blocks = resolve_blocks(acme.kv_cache.max_blocks, engine.capacity_blocks)
    first_turns = [(s.turns[0].new_tokens, s.turns[0].output_tokens, s.max_tokens)
                   for s in generate_sessions(scenario) if s.tenant == "acme"]
    full = [math.ceil((p + min(m or 0, engine.max_model_len - p)) / engine.block_size)
            for p, _, m in first_turns]
    held = [math.ceil((p + o) / engine.block_size) for p, o, _ in first_turns]
    assert sum(sorted(full)[:4]) > max_blocks
    assert 12 * sorted(held)[len(held) // 2] < max_blocks
