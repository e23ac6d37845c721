"""The vLLM compatibility layer: version gate, configuration probes, cache reset."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from plugin_policies import Tokens, engine_policy, tenant, write_policy

from engine_sidecar.plugin import vllm_compat
from engine_sidecar.plugin.core.engine_port import Engine
from engine_sidecar.plugin.vllm_compat import UnsupportedVllmError, check_supported_vllm


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.4", "0.32.0+cpu", "0.33.0", "0.33.1", "0.34.0", "0.34.2"]
)
def test_supported_versions_pass(version):
    check_supported_vllm(version)


def test_the_gate_follows_the_one_list_of_verified_releases():
    assert vllm_compat.SUPPORTED_VLLM == ("0.32", "0.33", "0.34")
    for version in vllm_compat.VERIFIED_VLLM:
        check_supported_vllm(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.340.1", "1.0.0"])
def test_unsupported_versions_are_refused_by_name(version, monkeypatch):
    monkeypatch.delenv(vllm_compat.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(UnsupportedVllmError) as error:
        check_supported_vllm(version)
    message = str(error.value)
    assert f"vLLM {version}" in message and "0.32.x, 0.33.x, 0.34.x" in message
    # Nothing is missing on the installed vLLM: the message says how to check the image.
    assert "every touchpoint it checks by name is present" in message
    assert vllm_compat.PREFLIGHT_COMMAND in message


def test_a_newer_vllm_missing_a_touchpoint_is_refused_naming_it(monkeypatch):
    """A future vLLM that renamed a hooked method: the message names it, and the
    override does not let the plugin start on it."""
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.delattr(BlockPool, "touch")
    monkeypatch.setenv(vllm_compat.ALLOW_UNSUPPORTED_ENV, "1")
    with pytest.raises(UnsupportedVllmError) as error:
        check_supported_vllm("0.35.0")
    message = str(error.value)
    assert "newer than 0.32.x, 0.33.x, 0.34.x" in message
    assert "missing scheduler touchpoints: BlockPool.touch" in message


def test_unsupported_version_can_be_tried_on_purpose(monkeypatch, caplog):
    monkeypatch.setenv(vllm_compat.ALLOW_UNSUPPORTED_ENV, "1")
    caplog.set_level(logging.WARNING)
    check_supported_vllm("0.35.0")
    assert "0.35.0" in caplog.text


def test_the_plugin_fails_at_construction_on_an_unsupported_vllm(make_harness, monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.99.1")
    with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.99\.1"):
        make_harness(num_blocks=64, scheduler="kvquota")


@pytest.mark.parametrize("null_ref_cnt", [0, 3], ids=["vllm-0.33", "vllm-0.32"])
def test_usage_counts_shared_prefix_blocks_once_behind_null_blocks(null_ref_cnt):
    """Sliding-window layouts lead with null blocks; vLLM 0.32 counts a reference on
    them per holder, 0.33 none. Either way the shared prefix behind them is shared."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from engine_sidecar.plugin.vllm_engine import VllmEngine

    null = KVCacheBlock(block_id=0, ref_cnt=null_ref_cnt, is_null=True)
    prefix = KVCacheBlock(block_id=7, ref_cnt=2)
    own = KVCacheBlock(block_id=8, ref_cnt=1)
    shared: set[int] = set()
    assert VllmEngine.count_unshared_blocks([null, null, prefix, own], shared) == 1
    assert shared == {7}


@pytest.mark.parametrize(("cache", "transfer", "expected"), [
    ({"kv_offloading_size": None}, None, False),
    ({"kv_offloading_size": 8.0}, None, True),
    ({"kv_offloading_size": None}, {"kv_connector": "OffloadingConnector"}, True),
    ({"kv_offloading_size": None}, {"kv_connector": "LMCacheConnectorV1"}, True),
    ({"kv_offloading_size": None}, {"kv_connector": "NixlConnector"}, False),
])
def test_offloading_is_detected_from_the_engine_config(cache, transfer, expected):
    config = SimpleNamespace(
        cache_config=SimpleNamespace(**cache),
        kv_transfer_config=SimpleNamespace(**transfer) if transfer else None,
    )
    assert vllm_compat.offloading_configured(config) is expected  # type: ignore[arg-type]


def test_prefix_cache_reset_releases_leases_first(make_harness, policy_path):
    write_policy(policy_path, engine_policy(tenant("acme", guaranteed=100, lease_seconds=300)))
    harness = make_harness(num_blocks=101, block_size=16, policy_path=policy_path)
    harness.add_request("t1", Tokens()(320), 8, tenant="acme", session="s1")
    harness.run_until_done()
    assert harness.kvq_stats().tenants["acme"].leased_sessions == 1

    assert harness.scheduler.reset_prefix_cache() is True
    stats = harness.kvq_stats()
    assert stats.tenants["acme"].leased_sessions == 0
    assert stats.tenants["acme"].lease_drops == {"reset": 1}
    assert stats.free_blocks == stats.total_blocks


def _parameters(function: Callable[..., object]) -> list[inspect.Parameter]:
    return [p for name, p in inspect.signature(function).parameters.items() if name != "self"]


@pytest.mark.parametrize("implementation", ["VllmEngine", "FakeEngine"])
def test_vllm_and_the_rule_tests_fake_implement_the_same_port(implementation):
    """Every call the parts make on `engine_port.Engine` exists, with the same
    parameters, on vLLM's adapter and on the fake the rule tests run on: a rule
    proved on one runs on the other (extra parameters need defaults)."""
    from engine_sidecar.plugin.vllm_engine import VllmEngine

    engine = {"VllmEngine": VllmEngine, "FakeEngine": FakeEngine}[implementation]
    port = [name for name, _ in inspect.getmembers(Engine, inspect.isfunction)
            if not name.startswith("_")]
    assert len(port) == 25
    for name in port:
        wanted = [p.name for p in _parameters(getattr(Engine, name))]
        given = _parameters(getattr(engine, name))
        assert [p.name for p in given[:len(wanted)]] == wanted, name
        assert all(p.default is not p.empty for p in given[len(wanted):]), name

