"""Peering set-up, namespaced and cluster-wide, and whom the operator's writes name.

`kvquota operator --namespace X --require-peering` meets its peers in a KopfPeering in
X, which it creates. Where it cannot (kopf's peering CRD missing, RBAC refusing), a
required peering would keep the replica paused for ever, said only at debug level
(issue #45, finding 4): it stops at start instead, naming the CRD or the permission.
Every write of the operator, its own and kopf's, names the field manager
`kvquota-operator` (finding 6), not the Python client's `OpenAPI-Generator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
from operator_harness import WAIT, Cluster, FakeEngines
from operator_objects import pool, quota
from test_operator_ha import PEERING, guarantee_is

from kvquota.reconcile.kube import FIELD_MANAGER
from kvquota_lab.emulator import Write
from kvquota_lab.emulator_process import OperatorProcess

NAMESPACED = ("--require-peering", "--priority", "100", "--poll-interval", "0.5")


async def run_until_exit(process: OperatorProcess) -> tuple[int, str]:
    """Run the operator's command line to its exit: (exit code, its output). A replica
    that stays up (paused) past the harness's wait fails the test."""
    proc = await asyncio.create_subprocess_exec(
        *process.command(), env={**os.environ, **process.environment()},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), WAIT)
    except TimeoutError:
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
        raise AssertionError(f"the operator still ran after {WAIT}s instead of stopping "
                             "at start") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def operator_writes(writes: list[Write]) -> dict[str, set[str]]:
    """resource -> the managers that wrote it, leaving out the test's own writes
    (aiohttp's User-Agent: `Python/...`)."""
    found: dict[str, set[str]] = {}
    for write in writes:
        if write.manager != "Python":
            found.setdefault(write.resource, set()).add(write.manager)
    return found


async def test_namespaced_operator_with_required_peering_works_in_its_namespace(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.install_peering_crd(namespaced=True)  # the object itself: the operator's
    cluster.server.writes = []
    await cluster.create(pool(capacity=10_000))
    await cluster.create(quota("acme", guaranteed=100, maximum=5000))
    operator = OperatorProcess(cluster.url, tmp_path, identity="replica-ns",
                               namespaces=["default"], args=NAMESPACED)
    await operator.start(WAIT)
    try:
        await guarantee_is(cluster, 100)  # not paused: it reconciles

        async def registered() -> bool:
            return "replica-ns" in await cluster.peers(PEERING, namespace="default")

        await cluster.wait_for(registered, "the replica in the KopfPeering of default")
    finally:
        await operator.stop()
    # Its peering object, keep-alives, ConfigMap and status all name our manager.
    written = operator_writes(cluster.server.writes)
    assert written["kopfpeerings.kopf.dev"] == {FIELD_MANAGER}, written
    assert written["configmaps"] == {FIELD_MANAGER}, written
    assert written["tenantquotas.kvquota.dev/status"] == {FIELD_MANAGER}, written


@pytest.mark.parametrize(("scope", "crd"), [
    (["default"], "kopfpeerings.kopf.dev"),
    ([], "clusterkopfpeerings.kopf.dev"),
], ids=["namespaced", "cluster-wide"])
async def test_required_peering_without_its_crd_stops_at_start_naming_it(
    cluster: Cluster, tmp_path: Path, scope: list[str], crd: str
) -> None:
    operator = OperatorProcess(cluster.url, tmp_path, namespaces=scope, args=NAMESPACED)
    code, output = await run_until_exit(operator)
    assert code != 0, output
    # Said at the default log level (no -v), as an error, and as the exit message.
    assert any("ERROR" in line and f"peering CRD {crd} is not installed" in line
               for line in output.splitlines()), output
    assert (f"kvquota operator: --require-peering: kopf's peering CRD {crd} is not "
            "installed") in output, output
    assert "kubectl apply --server-side -k manifests/crds" in output


async def test_required_peering_that_rbac_forbids_stops_at_start_naming_the_permission(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.install_peering_crd(namespaced=True)
    cluster.server.forbidden.add(("kopf.dev", "kopfpeerings"))
    operator = OperatorProcess(cluster.url, tmp_path, namespaces=["default"],
                               args=NAMESPACED)
    code, output = await run_until_exit(operator)
    assert code != 0, output
    assert ("kvquota operator: --require-peering: the operator's account may not create "
            "the KopfPeering 'kvquota' in namespace default: its role needs get, list, "
            "watch, patch and create on kopfpeerings.kopf.dev") in output, output


async def test_optional_peering_without_its_crd_runs_unpaired(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Without --require-peering a missing CRD is a warning: one replica still works."""
    await cluster.create(pool(capacity=10_000))
    await cluster.create(quota("acme", guaranteed=100, maximum=5000))
    operator = OperatorProcess(cluster.url, tmp_path, namespaces=["default"])
    await operator.start(WAIT)
    try:
        await guarantee_is(cluster, 100)
    finally:
        await operator.stop()
    assert "running without peering" in operator.log_path.read_text()


async def test_every_write_of_the_operator_names_its_field_manager(
    cluster: Cluster, engines: FakeEngines, operator: object
) -> None:
    """In-process operator (kopf and our client): pools' kopf annotations, status of
    both kinds, the policy ConfigMap and events all come from `kvquota-operator`; the
    writes of our own client also pass it as `fieldManager`."""
    cluster.server.writes = []
    await cluster.create(pool())
    await cluster.create(quota("acme", guaranteed=100, maximum=400))
    await engines.add("engine-0")
    await guarantee_is(cluster, 100)
    await cluster.wait_status("InferencePool", "demo-pool",
                              lambda o: bool((o.get("status") or {}).get("conditions")) and
                              "kvquota.dev/last-handled-configuration" in
                              (o["metadata"].get("annotations") or {}),
                              "status and kopf's handled-spec annotation written")
    await cluster.wait_status("TenantQuota", "acme",
                              lambda o: bool((o.get("status") or {}).get("conditions")),
                              "status written")

    async def events_posted() -> bool:
        return any(w.resource == "events" and w.manager != "Python"
                   for w in cluster.server.writes or [])

    await cluster.wait_for(events_posted, "an event from the operator")
    written = operator_writes(cluster.server.writes)
    assert set(written) >= {"configmaps", "events", "inferencepools.kvquota.dev",
                            "inferencepools.kvquota.dev/status",
                            "tenantquotas.kvquota.dev/status"}, written
    assert set().union(*written.values()) == {FIELD_MANAGER}, written
    explicit = {w.resource for w in cluster.server.writes if w.field_manager == FIELD_MANAGER}
    assert explicit >= {"configmaps", "inferencepools.kvquota.dev/status",
                        "tenantquotas.kvquota.dev/status"}, explicit
