"""High availability: two `kvquota operator` processes with kopf peering (distinct
priorities, `--require-peering`, as manifests/overlays/ha runs them) against the emulator.

The leader works; the standby stays paused while the leader's keep-alive in the
ClusterKopfPeering is fresh, so only one of them ever writes. A leader that dies is
replaced once its entry expires (`--peering-lifetime` after its last keep-alive); one
that exits cleanly removes its entry, and the standby resumes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from conftest import SpawnOperator
from operator_harness import Cluster
from operator_objects import pool, quota
from test_operator_metrics import samples, value

from engine_sidecar.contract.names import POLICY_FILE
from kvquota.reconcile.configmap import configmap_name
from kvquota_lab.emulator_process import OperatorProcess

PEERING = "kvquota"  # kvquota.settings.PEERING_NAME
# A short lease so the test waits seconds, not a minute. kopf renews an entry every
# max(1, lifetime - 5..10) s, i.e. every second here.
LIFETIME = 4
HA = ("--require-peering", "--peering-lifetime", str(LIFETIME), "--poll-interval", "0.5")
CM = configmap_name("demo-pool")


@contextlib.asynccontextmanager
async def policies_written(cluster: Cluster) -> AsyncIterator[list[dict[str, int]]]:
    """Every version of the pool's policy as the API server stores it (a watch), as
    tenant -> guaranteedBlocks: what engines would load, in order."""
    seen: list[dict[str, int]] = []

    async def watch() -> None:
        url = f"{cluster.url}/api/v1/namespaces/default/configmaps?watch=true"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            async for line in response.content:
                event = json.loads(line)
                cm = event.get("object") or {}
                if event.get("type") == "DELETED" or cm["metadata"]["name"] != CM:
                    continue
                policy = json.loads(cm["data"][POLICY_FILE])
                tenants = {t: p["guaranteedBlocks"] for t, p in policy["tenants"].items()}
                if not seen or seen[-1] != tenants:
                    seen.append(tenants)

    task = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def guarantee_is(cluster: Cluster, blocks: int) -> None:
    async def probe() -> bool:
        policy = await cluster.policy("demo-pool")
        return policy is not None and policy.tenants["acme"].guaranteed_blocks == blocks

    await cluster.wait_for(probe, f"acme guaranteed {blocks} in the policy")


async def edit(cluster: Cluster, blocks: int) -> None:
    await cluster.patch("TenantQuota", "acme", {"spec": {"kvCache": {"guaranteedBlocks": blocks}}})


async def writes(operator: OperatorProcess) -> dict[str, float]:
    found = samples(await operator.metrics())
    return {
        "policy": value(found, "kvquota_operator_policy_writes_total") or 0,
        "reconciles": sum(v for (name, _), v in found.items()
                          if name == "kvquota_operator_reconciles_total"),
    }


async def leader_and_standby(cluster: Cluster, spawn: SpawnOperator, *extra: str
                             ) -> tuple[OperatorProcess, OperatorProcess]:
    cluster.install_peering_crd()  # the object itself is created by the operator
    await cluster.create(pool(capacity=10_000))
    await cluster.create(quota("acme", guaranteed=100, maximum=5000))
    leader = await spawn("replica-a", *HA, *extra, "--priority", "100")
    await guarantee_is(cluster, 100)
    standby = await spawn("replica-b", *HA, *extra, "--priority", "50")

    async def both_peers() -> Any:
        return {"replica-a", "replica-b"} <= set(await cluster.peers(PEERING))

    await cluster.wait_for(both_peers, "both replicas in the peering object")
    return leader, standby


async def test_only_the_leader_writes_and_the_standby_takes_over_when_it_dies(
    cluster: Cluster, spawn_operator: SpawnOperator
) -> None:
    async with policies_written(cluster) as seen:
        leader, standby = await leader_and_standby(cluster, spawn_operator)
        for blocks in (110, 120, 130):
            await edit(cluster, blocks)
            await guarantee_is(cluster, blocks)
        assert await writes(standby) == {"policy": 0, "reconciles": 0}
        assert (await writes(leader))["policy"] >= 3

        lastseen = datetime.datetime.fromisoformat(
            (await cluster.peers(PEERING))["replica-a"]["lastseen"])
        leader.kill()  # no clean exit: its entry stays until it expires
        await edit(cluster, 140)
        # Until the leader's last keep-alive expires, the standby must not act. Checked
        # half a second before the earliest expiry (a keep-alive sent after we read
        # `lastseen` only moves the expiry later).
        expiry = lastseen + datetime.timedelta(seconds=LIFETIME)
        pause = (expiry - datetime.datetime.now(datetime.UTC)).total_seconds() - 0.5
        await asyncio.sleep(max(pause, 0))
        policy = await cluster.policy("demo-pool")
        assert policy is not None and policy.tenants["acme"].guaranteed_blocks == 130
        assert await writes(standby) == {"policy": 0, "reconciles": 0}

        await guarantee_is(cluster, 140)  # the standby took over
        assert (await writes(standby))["policy"] >= 1

    # Never two writers: every policy the API server held carries the edits in order
    # (a paused or stale replica writing would put an older guarantee back).
    sequence = [tenants["acme"] for tenants in seen]
    assert sequence == sorted(sequence), sequence
    assert sequence[-1] == 140


async def test_a_leader_that_exits_cleanly_hands_over_at_once(
    cluster: Cluster, spawn_operator: SpawnOperator
) -> None:
    # A lease far longer than any wait of the harness: the standby can only take over
    # within the wait because the leader removed its entry on the way out.
    leader, standby = await leader_and_standby(cluster, spawn_operator,
                                               "--peering-lifetime", "600")
    assert await leader.stop() == 0
    assert "replica-a" not in await cluster.peers(PEERING)
    await edit(cluster, 150)
    await guarantee_is(cluster, 150)
    assert (await writes(standby))["policy"] >= 1
