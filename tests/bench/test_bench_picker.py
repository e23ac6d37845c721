"""The pool twin's router built from the shipped picker configuration
(manifests/examples/picker/epp-config.yaml): what it refuses to model, and how it
filters and scores engines per tier."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvquota_lab.bench.picker_config import (
    SHIPPED_CONFIG,
    PickerConfigError,
    load_picker_config,
    parse_picker_config,
)
from kvquota_lab.bench.picker_router import ConfiguredPicker
from kvquota_lab.bench.router_choice import make_router
from kvquota_lab.bench.routers import EngineLoad, RouteRequest

KV, WAITING = "kvquota:kv_cache_usage_perc", "kvquota:num_requests_waiting"


def _shipped() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(SHIPPED_CONFIG.read_text())
    return document


def _plugin(document: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in document["plugins"] if p.get("name", p["type"]) == name)


def test_the_shipped_config_is_what_the_twin_runs_by_default() -> None:
    config = load_picker_config()
    assert set(config.profiles) == {"premium", "standard", "free"}
    premium = config.profiles["premium"]
    (kv_filter,) = premium.filters
    assert config.attributes[kv_filter.attribute] == (KV, (("tier", "premium"),))
    assert (kv_filter.operator, kv_filter.value, kv_filter.fallback_on_empty) == (
        "LessThan", 0.8, True)
    weights = {s.kind if s.attribute is None else config.attributes[s.attribute][0]: s.weight
               for s in premium.scorers}
    assert weights == {"session-affinity-scorer": 3, "prefix-cache-scorer": 2,
                       WAITING: 1, KV: 1}
    router = make_router("prefix-affinity", 4, block_size=16, capacity_blocks=2000,
                         model="m", config=config)
    assert isinstance(router, ConfiguredPicker)
    assert router.block_size == 64  # the prefix producer's floor over vLLM's 16


@pytest.mark.parametrize(("edit", "named"), [
    (lambda d: d["plugins"].append({"type": "random-picker"}), "plugin 'random-picker'"),
    (lambda d: _plugin(d, "premium-kv-room")["parameters"].update(percentile=5),
     "parameter percentile"),
    (lambda d: _plugin(d, "session-affinity-scorer").update(
        parameters={"strategy": "session_id"}), "parameter strategy"),
    (lambda d: _plugin(d, "metrics-data-source").update(parameters={"interval": "1s"}),
     "parameter interval"),
    (lambda d: _plugin(d, "free-kv-room")["parameters"].update(fallbackOnEmpty=False),
     "fallbackOnEmpty: true only"),
    (lambda d: d.update(flowControl={}), "does not model flowControl"),
])
def test_a_config_naming_what_the_twin_does_not_model_is_refused(edit: Any, named: str) -> None:
    document = copy.deepcopy(_shipped())
    edit(document)
    with pytest.raises(PickerConfigError, match=named):
        parse_picker_config(document)


def _engine(premium_kv: float | None, premium_waiting: int = 0, free_kv: float = 0.1,
            free_waiting: int = 0) -> EngineLoad:
    series = {(WAITING, (("tier", "premium"),)): float(premium_waiting),
              (WAITING, (("tier", "free"),)): float(free_waiting),
              (KV, (("tier", "free"),)): free_kv}
    if premium_kv is not None:
        series[(KV, (("tier", "premium"),))] = premium_kv
    return EngineLoad(kv_usage=0.0, waiting=0, running=0, series=series)


def _picker(engines: int) -> ConfiguredPicker:
    return ConfiguredPicker(load_picker_config(), engines, block_size=16,
                            capacity_blocks=2000, model="m")


def test_the_tier_header_picks_the_profile_and_its_filter_drops_full_engines() -> None:
    """Engine 0 holds the session's whole prefix and its token; premium's series read it
    0.85 full there, so premium's profile leaves it out; the free tier's series read it
    empty, and free's profile sends the same request there."""
    prompt = list(range(640))
    loads = [_engine(0.85, free_kv=0.0), _engine(0.3, free_kv=0.6), _engine(0.5, free_kv=0.6)]
    picker = _picker(3)
    first = RouteRequest("acme", "s", prompt, "acme", tier="premium")
    assert picker.pick(first, [_engine(0.0)] * 3) == 0  # indexed on engine 0
    follow = RouteRequest("acme", "s", prompt + [1] * 64, "acme", token_engine=0,
                          tier="premium")
    assert picker.pick(follow, loads) == 1  # the emptier of the two left
    as_free = RouteRequest("acme", "s", prompt + [1] * 64, "acme", token_engine=0,
                           tier="free")
    assert picker.pick(as_free, loads) == 0
    # No header: the default profile (free).
    no_header = RouteRequest("acme", "s", prompt + [1] * 64, "acme", token_engine=0)
    assert picker.pick(no_header, loads) == 0


def test_with_every_engine_full_all_stay_and_one_without_the_series_is_kept() -> None:
    prompt = list(range(640))
    picker = _picker(3)
    request = RouteRequest("acme", "s", prompt, "acme", token_engine=2, tier="premium")
    full = [_engine(0.9), _engine(0.95), _engine(0.85)]
    assert picker.pick(request, full) == 2  # fallbackOnEmpty: the token decides
    # onMissing: Pass keeps an engine whose capacity is not known yet; it scores 0 on
    # the KV scorer, so the one with room below the threshold wins.
    unknown = [_engine(0.9), _engine(None), _engine(0.5)]
    assert picker.pick(RouteRequest("acme", "t", [7] * 10, "acme", tier="premium"),
                       unknown) == 2


def test_a_refused_free_request_retries_where_free_has_some_room() -> None:
    """Every engine reads 0.8 or more to free. The retry's token and prefix name engine
    0, which refused it with no room left (0.99); free's looser filter keeps the engines
    with under 0.95, so the retry goes to one of them, not back to engine 0. Once every
    engine reads 0.95 or more, both filters keep all and the token decides again."""
    prompt = list(range(640))
    picker = _picker(3)
    first = RouteRequest("hob", "b", prompt, "hob", tier="free")
    assert picker.pick(first, [_engine(0.0)] * 3) == 0  # indexed on engine 0
    retry = RouteRequest("hob", "b", prompt, "hob", token_engine=0, tier="free")
    full = [_engine(0.0, free_kv=0.99), _engine(0.0, free_kv=0.97),
            _engine(0.0, free_kv=0.85)]
    assert picker.pick(retry, full) == 2
    fuller = [_engine(0.0, free_kv=0.99), _engine(0.0, free_kv=0.97),
              _engine(0.0, free_kv=0.96)]
    assert picker.pick(retry, fuller) == 0
    # Premium keeps its single filter: its token's engine (its lease) still decides.
    as_premium = RouteRequest("hob", "b", prompt, "hob", token_engine=0, tier="premium")
    assert picker.pick(as_premium, [_engine(0.99), _engine(0.97), _engine(0.85)]) == 0


def test_the_queue_series_is_scored_over_the_candidates_range() -> None:
    """endpoint-attribute-scorer, adaptive range: the shortest premium queue scores 1,
    the longest 0, whatever the free tier's queue."""
    picker = _picker(2)
    loads = [_engine(0.2, premium_waiting=3, free_waiting=0),
             _engine(0.2, premium_waiting=1, free_waiting=40)]
    assert picker.pick(RouteRequest("acme", "s", [5] * 10, "acme", tier="premium"),
                       loads) == 1
    assert picker.pick(RouteRequest("hob", "f", [5] * 10, "hob", tier="free"), loads) == 0


def test_bench_defaults_run_the_shipped_config(tiny_scenario: Path) -> None:
    """`kvquota bench --replicas N --router prefix-affinity` with no other flag: KVQuota's
    signals and the shipped picker; the session token names the engine the session's
    previous request went to, as the scorer rewrites it on every response."""
    from kvquota_lab.bench.cost import load_profile
    from kvquota_lab.bench.policies import POLICIES
    from kvquota_lab.bench.pool import PoolRun, PoolSpec
    from kvquota_lab.bench.runner import BenchOptions
    from kvquota_lab.bench.scenario import parse_scenario

    options = BenchOptions(scenario=str(tiny_scenario))
    assert options.picker_signals == ("kvquota",) and options.picker_config is None
    scenario = parse_scenario(tiny_scenario.read_text(), source="tiny")
    run = PoolRun(scenario, POLICIES["kvquota"],
                  PoolSpec(2, "prefix-affinity", signals=options.picker_signals[0]),
                  load_profile(scenario.profile))
    assert isinstance(run.router, ConfiguredPicker)
    stock = PoolRun(scenario, POLICIES["priority"],
                    PoolSpec(2, "prefix-affinity", signals="kvquota"),
                    load_profile(scenario.profile))
    assert not isinstance(stock.router, ConfiguredPicker)  # no sidecar: vLLM's series
    result = run.run()
    assert result.extra["pool"]["pickerConfig"] == str(SHIPPED_CONFIG)
    # Every session that sent a request carries a token, free and premium alike.
    assert set(run.token_engines) == {s.session_id for s in run.sessions}
    assert set(run.token_engines.values()) <= {0, 1}
