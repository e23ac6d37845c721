"""The operator's /metrics and kopf's liveness endpoint, scraped from a running
`kvquota operator` process (kopf against the KMock emulator, fake engines)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from conftest import SpawnOperator
from operator_harness import Cluster, FakeEngines
from operator_objects import condition, pool, quota
from prometheus_client.parser import text_string_to_metric_families

from kvquota import metrics
from kvquota.cli import main
from kvquota_lab.emulator_process import OperatorProcess
from kvquota_lab.processes import free_port

Labels = frozenset[tuple[str, str]]


def samples(text: str) -> dict[tuple[str, Labels], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, Labels], float], name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


POOL = {"namespace": "default", "pool": "demo-pool"}


async def scrape_until(cluster: Cluster, operator: OperatorProcess, check: object,
                       what: str) -> dict[tuple[str, Labels], float]:
    async def probe() -> dict[tuple[str, Labels], float] | None:
        found = samples(await operator.metrics())
        return found if check(found) else None  # type: ignore[operator]

    return await cluster.wait_for(probe, what)


async def test_a_running_operator_serves_metrics_and_liveness(
    cluster: Cluster, engines: FakeEngines, spawn_operator: SpawnOperator
) -> None:
    engine = await engines.add("engine-a", follow=False)  # reports no policy: stale
    await cluster.create(pool(capacity=1000))  # guarantees up to 850 (watermark 0.15)
    await cluster.create(quota("acme", guaranteed=800))
    await cluster.create(quota("globex", guaranteed=100))  # younger, does not fit
    operator = await spawn_operator(
        "kvquota-operator-0", "--standalone", "--poll-interval", "0.2",
        "--engine-timeout", "0.5")

    await cluster.wait_status(
        "TenantQuota", "globex",
        lambda o: condition(o.get("status"), "Accepted")["reason"] == "Oversubscribed"
        if o.get("status") else False, "globex refused")
    found = await scrape_until(
        cluster, operator,
        lambda f: value(f, "kvquota_operator_quotas_refused", **POOL, reason="Oversubscribed")
        == 1 and value(f, "kvquota_operator_engines_observed", **POOL) == 1,
        "one refused quota and one engine in the metrics")
    assert value(found, "kvquota_operator_engines_stale", **POOL) == 1
    assert value(found, "kvquota_operator_quotas_refused", **POOL, reason="InvalidSpec") == 0
    quota_ok = value(found, "kvquota_operator_reconciles_total", kind="TenantQuota", result="ok")
    assert quota_ok is not None and quota_ok >= 2  # both quotas were handled
    assert (value(found, "kvquota_operator_reconcile_duration_seconds_count",
                  kind="TenantQuota") or 0) >= quota_ok
    assert (value(found, "kvquota_operator_reconciles_total",
                  kind="InferencePool", result="ok") or 0) >= 1
    assert (value(found, "kvquota_operator_change_to_configmap_seconds_count") or 0) >= 2
    writes = value(found, "kvquota_operator_policy_writes_total")
    assert writes is not None and writes >= 1

    # The engine picks up the policy: no longer stale. The refused quota fits once
    # the older one asks for less; the gauge follows, and the policy is written again.
    engine.follow = True
    await cluster.patch("TenantQuota", "acme", {"spec": {"kvCache": {"guaranteedBlocks": 500}}})
    found = await scrape_until(
        cluster, operator,
        lambda f: value(f, "kvquota_operator_engines_stale", **POOL) == 0
        and value(f, "kvquota_operator_quotas_refused", **POOL, reason="Oversubscribed") == 0,
        "no stale engine and no refused quota in the metrics")
    assert (value(found, "kvquota_operator_policy_writes_total") or 0) > writes

    status, body = await operator.liveness()
    assert status == 200
    assert "reconciles" in json.loads(body)  # our kopf probe, answered by kopf's endpoint


async def test_webhook_calls_are_counted_on_the_metrics_endpoint() -> None:
    """`record_webhook_call` is what the admission webhook calls per review."""
    server = metrics.MetricsServer("127.0.0.1", free_port())
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as response:
                before = value(samples(await response.text()),
                               "kvquota_operator_webhook_calls_total",
                               kind="TenantQuota", operation="CREATE", result="denied") or 0
            metrics.record_webhook_call("TenantQuota", "CREATE", "denied")
            metrics.record_webhook_call("TenantQuota", "CREATE", "allowed")
            async with http.get(url) as response:
                after = samples(await response.text())
        assert value(after, "kvquota_operator_webhook_calls_total", kind="TenantQuota",
                     operation="CREATE", result="denied") == before + 1
    finally:
        server.close()


@pytest.mark.parametrize("address", ["9090", "host:port", "0.0.0.0:70000"])
def test_a_bad_metrics_address_is_refused_by_name(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["operator", "--metrics", address])
    assert f"metrics address {address!r}: expected HOST:PORT" in capsys.readouterr().err
