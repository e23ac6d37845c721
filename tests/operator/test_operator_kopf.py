"""The real operator (kopf) against the KMock API emulator, over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from operator_harness import Cluster, FakeEngines, ManualClock
from operator_objects import condition, pool, quota

from engine_sidecar.contract.names import POLICY_FILE
from engine_sidecar.contract.policy import EnginePolicy
from kvquota.reconcile.configmap import HASH_ANNOTATION, configmap_name
from kvquota.runtime import OperatorConfig
from kvquota_lab.emulator import OperatorRunner

CM = configmap_name("demo-pool")


def _is(obj: dict[str, Any], type_: str, status: str, reason: str | None = None) -> bool:
    try:
        found = condition(obj.get("status"), type_)
    except AssertionError:
        return False
    return found["status"] == status and (reason is None or found["reason"] == reason)


def _handled(obj: dict[str, Any]) -> bool:
    """kopf has stored the spec it handled (its last write after a handler)."""
    return "kvquota.dev/last-handled-configuration" in (obj["metadata"].get("annotations") or {})


async def test_create_renders_configmap_owned_by_the_pool(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    created_pool = await cluster.create(pool())
    await cluster.create(quota("acme", tier="premium", guaranteed=200, maximum=400))
    await cluster.create(quota("globex", guaranteed=100, maximum=300))

    async def both_tenants() -> Any:
        policy = await cluster.policy("demo-pool")
        return policy if policy and sorted(policy.tenants) == ["acme", "globex"] else None

    policy = await cluster.wait_for(both_tenants, "a policy with both tenants")
    assert policy.tenants["acme"].priority == 0
    assert policy.tenants["acme"].guaranteed_blocks == 200  # no ready engine: one replica
    cm = await cluster.get("ConfigMap", CM)
    assert cm is not None
    assert cm["metadata"]["annotations"][HASH_ANNOTATION] == policy.version
    (owner,) = cm["metadata"]["ownerReferences"]
    assert owner["kind"] == "InferencePool" and owner["controller"] is True
    assert owner["uid"] == created_pool["metadata"]["uid"]

    acme = await cluster.wait_status("TenantQuota", "acme",
                                     lambda o: _is(o, "Accepted", "True"), "Accepted")
    assert acme["status"]["observedGeneration"] == 1
    assert acme["status"]["effective"]["guaranteedBlocksPerEngine"] == 200
    assert _is(acme, "Ready", "False", "NoReadyEngines")
    assert _is(acme, "Degraded", "Unknown")
    demo = await cluster.wait_status("InferencePool", "demo-pool",
                                     lambda o: _is(o, "Ready", "False", "NoEngines"), "Ready")
    assert demo["status"]["policyHash"] == policy.version
    assert demo["status"]["guaranteedBlocks"] == 300
    assert _is(demo, "Oversubscribed", "False")
    assert POLICY_FILE in cm["data"]


async def test_operator_bookkeeping_uses_our_prefix_and_blocks_no_deletion(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool())
    await cluster.create(quota("acme"))

    acme = await cluster.wait_status("TenantQuota", "acme",
                                     lambda o: _is(o, "Accepted", "True"), "Accepted")
    demo = await cluster.wait_status("InferencePool", "demo-pool", _handled, "handled")
    foreign = [k for k in demo["metadata"].get("annotations", {})
               if not k.startswith("kvquota.dev/")]
    assert foreign == []
    # Quotas are handled by an event handler: kopf writes nothing to them at all (no
    # copy of the spec per edit), only our status.
    assert not acme["metadata"].get("annotations")
    # Neither pools nor quotas carry a finalizer: deleting one never waits for the
    # operator.
    assert not demo["metadata"].get("finalizers")
    assert not acme["metadata"].get("finalizers")


async def _policy_where(cluster: Cluster, check: Any, what: str) -> Any:
    async def probe() -> Any:
        policy = await cluster.policy("demo-pool")
        return policy if policy is not None and check(policy) else None

    return await cluster.wait_for(probe, what)


async def test_update_moves_policy_and_generation(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool())
    await cluster.create(quota("acme", guaranteed=100, maximum=200))
    await cluster.wait_status("TenantQuota", "acme", lambda o: _is(o, "Accepted", "True"),
                              "Accepted")

    await cluster.patch("TenantQuota", "acme", {"spec": {"kvCache": {"guaranteedBlocks": 150}}})
    await _policy_where(cluster, lambda p: p.tenants["acme"].guaranteed_blocks == 150,
                        "the new guarantee in the policy")
    acme = await cluster.wait_status(
        "TenantQuota", "acme", lambda o: o["status"].get("observedGeneration") == 2,
        "observedGeneration 2")
    assert all(c["observedGeneration"] == 2 for c in acme["status"]["conditions"])
    assert acme["status"]["effective"]["guaranteedBlocks"] == 150

    # A pool edit (tier override) reaches every tenant of the pool.
    await cluster.patch("InferencePool", "demo-pool",
                        {"spec": {"tiers": {"standard": {"maxTokens": 100}}}})
    await _policy_where(cluster, lambda p: p.tenants["acme"].max_tokens == 100,
                        "the pool's tier override in the policy")
    await cluster.wait_status("InferencePool", "demo-pool",
                              lambda o: o["status"].get("observedGeneration") == 2,
                              "pool observedGeneration 2")


async def test_a_quota_moved_to_another_pool_leaves_the_first(
    cluster: Cluster, operator_config: OperatorConfig
) -> None:
    # No engine polls (they re-render every pool): only the move's event may do it.
    operator = OperatorRunner(dataclasses.replace(operator_config, poll_interval=3600))
    await operator.start()
    try:
        await _move_quota(cluster)
    finally:
        await operator.stop()


async def _move_quota(cluster: Cluster) -> None:
    await cluster.create(pool())
    await cluster.create(pool("other-pool"))
    await cluster.create(quota("acme", guaranteed=10))
    await cluster.create(quota("globex", guaranteed=10))
    await _policy_where(cluster, lambda p: sorted(p.tenants) == ["acme", "globex"],
                        "both tenants in demo-pool")

    await cluster.patch("TenantQuota", "acme", {"spec": {"poolRef": {"name": "other-pool"}}})
    await _policy_where(cluster, lambda p: list(p.tenants) == ["globex"], "acme gone")

    async def in_other() -> EnginePolicy | None:
        policy = await cluster.policy("other-pool")
        return policy if policy is not None and list(policy.tenants) == ["acme"] else None

    await cluster.wait_for(in_other, "acme in other-pool's policy")


async def test_delete_quota_and_pool(cluster: Cluster, operator: OperatorRunner) -> None:
    await cluster.create(pool())
    await cluster.create(quota("acme", guaranteed=10))
    await cluster.create(quota("globex", guaranteed=10))
    await _policy_where(cluster, lambda p: len(p.tenants) == 2, "two tenants")

    await cluster.delete("TenantQuota", "globex")
    await _policy_where(cluster, lambda p: list(p.tenants) == ["acme"], "globex removed")

    await cluster.delete("InferencePool", "demo-pool")

    async def configmap_gone() -> bool:
        return await cluster.get("ConfigMap", CM) is None

    await cluster.wait_for(configmap_gone, "the ConfigMap collected with its owner")
    await cluster.wait_status("TenantQuota", "acme",
                              lambda o: _is(o, "Ready", "False", "PoolNotFound"), "PoolNotFound")


async def test_quota_without_pool_waits_quietly_then_applies(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(quota("early", guaranteed=10, pool="later-pool"))
    early = await cluster.wait_status(
        "TenantQuota", "early", lambda o: _is(o, "Ready", "False", "PoolNotFound"),
        "PoolNotFound")
    assert _is(early, "Accepted", "False", "PoolNotFound")
    assert "later-pool" in condition(early["status"], "Ready")["message"]
    # The status is the last write (kopf keeps no bookkeeping on quotas), and the event
    # of our own write changes no spec: no hot retry loop, nothing rewrites the object.
    # A window can only miss a slow loop on a slow machine, never fail a correct operator.
    await asyncio.sleep(1.0)
    again = await cluster.get("TenantQuota", "early")
    assert again is not None
    assert again["metadata"]["resourceVersion"] == early["metadata"]["resourceVersion"]

    await cluster.create(pool("later-pool"))
    await cluster.wait_status("TenantQuota", "early", lambda o: _is(o, "Accepted", "True"),
                              "accepted once the pool exists")


async def test_oversubscription_refuses_the_newest_and_recovers(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool(capacity=1000))  # 850 guaranteeable
    # Created in this order; names sort the other way, so creation time must decide.
    await cluster.create(quota("zz-old", guaranteed=500, maximum=600))
    await cluster.create(quota("aa-new", guaranteed=400, maximum=500))

    new = await cluster.wait_status(
        "TenantQuota", "aa-new", lambda o: _is(o, "Accepted", "False", "Oversubscribed"),
        "newest refused")
    assert new["status"]["effective"]["guaranteedBlocks"] == 0
    await cluster.wait_status("TenantQuota", "zz-old", lambda o: _is(o, "Accepted", "True"),
                              "oldest keeps its guarantee")
    await cluster.wait_status("InferencePool", "demo-pool",
                              lambda o: _is(o, "Oversubscribed", "True"), "pool oversubscribed")
    policy = await cluster.policy("demo-pool")
    assert policy is not None and policy.tenants["aa-new"].guaranteed_blocks == 0

    async def warned() -> bool:
        return any(e.get("reason") == "Oversubscribed"
                   and e["involvedObject"]["name"] == "aa-new"
                   for e in await cluster.list("Event"))

    await cluster.wait_for(warned, "a Warning event on the refused quota")

    await cluster.delete("TenantQuota", "zz-old")
    await cluster.wait_status("TenantQuota", "aa-new", lambda o: _is(o, "Accepted", "True"),
                              "accepted once capacity frees up")
    await cluster.wait_status("InferencePool", "demo-pool",
                              lambda o: _is(o, "Oversubscribed", "False"), "no longer")


async def test_engines_split_sync_and_report_usage(
    cluster: Cluster, operator: OperatorRunner, engines: FakeEngines, clock: ManualClock
) -> None:
    await engines.add("engine-a")
    lagging = await engines.add("engine-b", follow=False)
    await cluster.create(pool(capacity=None))  # capacity from the engines' reports
    await cluster.create(quota("acme", tier="premium", guaranteed=300, maximum=601))

    policy = await _policy_where(cluster, lambda p: p.replicas == 2, "split over 2 replicas")
    assert policy.tenants["acme"].guaranteed_blocks == 150
    assert policy.tenants["acme"].max_blocks_per_engine == 301
    demo = await cluster.wait_status(
        "InferencePool", "demo-pool", lambda o: _is(o, "Synced", "False", "EnginesNotSynced"),
        "engine-b behind")
    assert demo["status"]["capacityBlocks"] == 2000
    assert "engine-b" in condition(demo["status"], "Synced")["message"]

    lagging.follow = True  # engine-b loads the ConfigMap
    demo = await cluster.wait_status("InferencePool", "demo-pool",
                                     lambda o: _is(o, "Synced", "True"), "all engines synced")
    assert demo["status"]["engines"] == {"ready": 2, "synced": 2}
    await cluster.wait_status("TenantQuota", "acme", lambda o: _is(o, "Ready", "True"),
                              "tenant settings applied everywhere")

    for engine in engines.engines.values():
        engine.report("acme", usage={"blocks": 40, "leasedBlocks": 10},
                      counters={"admitted": 5})
    acme = await cluster.wait_status(
        "TenantQuota", "acme", lambda o: (o["status"].get("usage") or {}).get("blocks") == 80,
        "usage summed over engines")
    assert acme["status"]["counters"]["admitted"] == 10
    assert acme["status"]["usage"]["leasedBlocks"] == 20
    assert _is(acme, "Degraded", "Unknown")  # the window is not yet observed in full
    clock.advance(operator.config.degraded_window)
    await cluster.wait_status("TenantQuota", "acme", lambda o: _is(o, "Degraded", "False"),
                              "no disruptions over a full window")

    engines.engines["engine-a"].report("acme", usage={"blocks": 40},
                                       counters={"admitted": 6, "preemptions": 3})
    await cluster.wait_status(
        "TenantQuota", "acme", lambda o: _is(o, "Degraded", "True", "PremiumPreemptions"),
        "Degraded after premium preemptions")


def _one_reconcile_done(operator: OperatorRunner) -> Any:
    """A probe for `wait_for`: the (re)started operator has finished a reconcile of the
    one pool (the second has started, and runs of a pool never overlap)."""
    async def probe() -> bool:
        return operator.reconciles >= 2

    return probe


async def test_restart_converges_on_changes_made_while_down(
    cluster: Cluster, operator: OperatorRunner
) -> None:
    await cluster.create(pool(capacity=1000))
    await cluster.create(quota("acme", guaranteed=100))
    await cluster.create(quota("globex", guaranteed=100))
    await _policy_where(cluster, lambda p: len(p.tenants) == 2, "two tenants")
    await cluster.wait_status("TenantQuota", "globex", lambda o: _is(o, "Accepted", "True"),
                              "globex accepted")

    await operator.stop()
    cm = await cluster.get("ConfigMap", CM)
    assert cm is not None
    untouched = cm["metadata"]["resourceVersion"]
    await operator.start()  # nothing changed: nothing is rewritten
    await cluster.wait_for(_one_reconcile_done(operator), "a reconcile after the restart")
    cm = await cluster.get("ConfigMap", CM)
    assert cm is not None and cm["metadata"]["resourceVersion"] == untouched

    await operator.stop()
    await cluster.patch("TenantQuota", "acme", {"spec": {"kvCache": {"guaranteedBlocks": 700}}})
    await cluster.delete("TenantQuota", "globex")  # no finalizer: gone without the operator
    assert await cluster.get("TenantQuota", "globex") is None
    await cluster.create(quota("initech", guaranteed=300))  # will not fit next to 700
    await operator.start()

    await _policy_where(
        cluster, lambda p: sorted(p.tenants) == ["acme", "initech"]
        and p.tenants["acme"].guaranteed_blocks == 700, "the changes made while down")
    acme = await cluster.wait_status(
        "TenantQuota", "acme", lambda o: o["status"].get("observedGeneration") == 2,
        "acme observed generation 2")
    assert _is(acme, "Accepted", "True")
    await cluster.wait_status(
        "TenantQuota", "initech", lambda o: _is(o, "Accepted", "False", "Oversubscribed"),
        "the new quota refused")


async def test_selector_from_a_gateway_api_inference_pool(
    cluster: Cluster, operator: OperatorRunner, engines: FakeEngines
) -> None:
    engines.labels = {"app": "gateway-engines"}
    await engines.add("engine-a")
    cluster.install_gateway_api()
    await cluster.create(pool(selector=None, gatewayPoolRef={"name": "gw-pool"}))
    await cluster.wait_status(
        "InferencePool", "demo-pool", lambda o: _is(o, "Ready", "False", "GatewayPoolNotFound"),
        "the missing Gateway API pool reported")

    await cluster.create({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "gw-pool", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "gateway-engines"}},
                 "targetPorts": [{"number": 8000}]},
    }, kind="GatewayInferencePool")
    demo = await cluster.wait_status("InferencePool", "demo-pool",
                                     lambda o: _is(o, "Ready", "True"), "engines found")
    assert demo["status"]["engines"]["ready"] == 1
