"""Policy hot-load: the polled file and the ConfigMap watch (against KMock)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import kmock

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.gateway.policy.active import PolicyHolder
from engine_sidecar.gateway.policy.source import ConfigMapPolicySource, FilePolicySource

from .helpers import Keys, make_policy, tenant, write_policy


async def _until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_file_source_validates_swaps_and_writes_for_the_plugin(
    keys: Keys, tmp_path: Path
) -> None:
    source_file, plugin_file = tmp_path / "policy.json", tmp_path / "run" / "policy.json"
    holder = PolicyHolder(keys.dir, plugin_file)
    source = FilePolicySource(source_file)
    first = make_policy(tenant("acme", max_tokens=16))
    write_policy(source_file, first)
    source.poll(holder)
    assert holder.active is not None and holder.active.version == first.version
    assert EnginePolicy.from_json(plugin_file.read_text()) == first

    source_file.write_text("{not json")
    source.poll(holder)
    assert holder.active.version == first.version and "invalid EnginePolicy" in str(holder.error)
    assert EnginePolicy.from_json(plugin_file.read_text()) == first  # plugin keeps it too

    source_file.unlink()
    source.poll(holder)
    assert "not found" in str(holder.error) and holder.active.version == first.version

    second = make_policy(tenant("acme", max_tokens=32))
    write_policy(source_file, second)
    source.poll(holder)
    assert holder.error is None and holder.active.version == second.version
    assert EnginePolicy.from_json(plugin_file.read_text()) == second


def test_unversioned_policies_get_their_hash_and_wrong_hashes_are_refused(
    keys: Keys, tmp_path: Path
) -> None:
    holder = PolicyHolder(keys.dir, None)
    body = json.loads(make_policy(tenant("acme")).to_json())
    holder.offer(json.dumps({**body, "version": ""}), "test")
    assert holder.active is not None and holder.active.version.startswith("sha256:")
    holder.offer(json.dumps({**body, "version": "sha256:0000000000000000"}), "test")
    assert "does not match its content" in str(holder.error)


def test_rotated_secrets_are_picked_up(tmp_path: Path) -> None:
    secrets_dir = Keys(tmp_path / "secrets").write().dir
    holder = PolicyHolder(secrets_dir, None)
    holder.offer(make_policy(tenant("acme")).to_json(), "test")
    assert holder.active is not None
    before = holder.active.cache_salts["acme"]
    (secrets_dir / "cache-salt").write_bytes(secrets.token_bytes(40))
    holder.refresh_secrets()
    assert holder.active.cache_salts["acme"] != before

    (secrets_dir / "cache-salt").write_bytes(b"short")
    holder.refresh_secrets()
    assert "only 5 bytes" in str(holder.error) and holder.active.cache_salts["acme"]


async def test_configmap_watch_hot_loads_and_survives_bad_updates(
    keys: Keys, tmp_path: Path
) -> None:
    from kubernetes import client

    async with kmock.KubernetesEmulator() as server, kmock.Server(server) as http:
        server.resources.load_bundled()
        url = str(http.url).rstrip("/")
        path = url + "/api/v1/namespaces/pools/configmaps"

        def api_client() -> Any:
            configuration = client.Configuration()
            configuration.host = url
            return client.ApiClient(configuration)

        async with httpx.AsyncClient(timeout=60) as http_client:  # not a speed test
            async def put_policy(raw: str) -> None:
                response = await http_client.patch(
                    path + "/pool-policy", json={"data": {"policy.json": raw}},
                    headers={"Content-Type": "application/merge-patch+json"})
                assert response.status_code == 200, response.text

            first = make_policy(tenant("acme", max_tokens=16))
            created = await http_client.post(path, json={
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "pool-policy", "namespace": "pools"},
                "data": {"policy.json": first.to_json()}})
            assert created.status_code < 300, created.text

            plugin_file = tmp_path / "plugin.json"
            holder = PolicyHolder(keys.dir, plugin_file)
            source = ConfigMapPolicySource("pools", "pool-policy", api_client_factory=api_client,
                                           secrets_interval=0.1)
            task = asyncio.create_task(source.run(holder))
            try:
                await _wait_version(holder, first)
                second = make_policy(tenant("acme", max_tokens=48))
                await put_policy(second.to_json())
                await _wait_version(holder, second)
                assert EnginePolicy.from_json(plugin_file.read_text()) == second

                await put_policy('{"pool": 1}')
                await _until(lambda: holder.error is not None, "the bad policy to be seen")
                assert holder.active is not None and holder.active.version == second.version
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def _wait_version(holder: PolicyHolder, policy: EnginePolicy) -> Awaitable[None]:
    return _until(lambda: holder.active is not None and holder.active.version == policy.version,
                  f"policy {policy.version}")


def test_a_policy_waiting_for_its_key_is_applied_when_the_key_is_mounted(
    keys: Keys, tmp_path: Path
) -> None:
    secrets_dir = Keys(tmp_path / "secrets").write().dir
    holder = PolicyHolder(secrets_dir, None)
    first = make_policy(tenant("acme"))
    holder.offer(first.to_json(), "test")
    waiting = make_policy(tenant("acme"), auth={"jwt": {"key_file": "rotated.pem",
                                                         "algorithms": ["RS256"]}})
    holder.offer(waiting.to_json(), "test")
    assert holder.active is not None and holder.active.version == first.version
    assert "'rotated.pem' not found" in str(holder.error)

    holder.refresh_secrets()  # nothing changed yet
    assert holder.active.version == first.version
    (secrets_dir / "rotated.pem").write_bytes(keys.rsa_public_pem())
    holder.refresh_secrets()
    assert holder.error is None and holder.active.version == waiting.version


def test_the_sidecar_enforces_its_engines_split_and_hands_the_plugin_the_whole_policy(
    tmp_path: Path,
) -> None:
    secrets_dir = Keys(tmp_path / "secrets").write().dir
    plugin_file = tmp_path / "run" / "policy.json"
    even = make_policy(tenant("acme", guaranteed_blocks=200, max_blocks_per_engine=300))
    split = EnginePolicy.model_validate({
        **even.model_dump(), "version": "",
        "engines": {"engine-a": {"acme": {"guaranteed_blocks": 320, "max_blocks_per_engine": 420}}},
    }).with_version()
    on_a = PolicyHolder(secrets_dir, plugin_file, engine="engine-a")
    assert on_a.offer(split.to_json(), "test")
    assert on_a.active is not None and on_a.active.version == split.version
    acme = on_a.active.policy.tenants["acme"]
    assert (acme.guaranteed_blocks, acme.max_blocks_per_engine) == (320, 420)
    # The plugin reads the policy as the operator rendered it (its hash still checks)
    # and picks the same entry by the same pod name.
    assert EnginePolicy.from_json(plugin_file.read_text()) == split
    (secrets_dir / "cache-salt").write_bytes(secrets.token_bytes(40))
    on_a.refresh_secrets()  # rebuilt from the policy as offered, not the local view
    assert EnginePolicy.from_json(plugin_file.read_text()) == split
    assert on_a.active.policy.tenants["acme"].guaranteed_blocks == 320

    on_b = PolicyHolder(secrets_dir, None, engine="engine-b")  # no entry: the even split
    assert on_b.offer(split.to_json(), "test") and on_b.active is not None
    assert on_b.active.policy.tenants["acme"].guaranteed_blocks == 200
