"""The endpoint-picker example (manifests/examples/picker): each picker reads series the
sidecar really serves, in the form its metric flags parse, scrapes and routes to the
port the sidecar owns, and lets a leased session's token outweigh the prefix scorer."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.contract.names import ADMIN_PORT
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.gateway.admission_queue import AdmissionQueue
from engine_sidecar.gateway.ledger import Ledger
from engine_sidecar.gateway.picker_signals import PickerSignals, SignalSources

from .conftest import build, one

EXAMPLE = "manifests/examples/picker"
METRIC_FLAGS = ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric")
PICKERS = {"demo-premium": "premium", "demo-shared": "all"}  # pool -> tier it reads


def _metric_spec(text: str) -> tuple[str, dict[str, str]]:
    """A picker's metric flag as the Inference Extension parses it (its
    stringToMetricSpec: `name` or `name{label=value,...}`, values taken verbatim, so a
    quoted value would keep its quotes and match nothing)."""
    name, brace, rest = text.strip().partition("{")
    labels: dict[str, str] = {}
    if brace:
        assert rest.endswith("}"), text
        for pair in rest[:-1].split(","):
            key, _, value = pair.strip().partition("=")
            assert key and value, text
            labels[key.strip()] = value.strip()
    return name.strip(), labels


def _served() -> list[tuple[str, dict[str, str]]]:
    """What a sidecar serves on its client port's scrape, for a pool of three tiers and
    a known capacity."""
    tenants = {
        t: {"tenantId": t, "tier": tier, "priority": p, "guaranteedBlocks": 0,
            "maxBlocks": 100, "maxTokens": 16, "defaultMaxTokens": 8}
        for t, tier, p in (("a", "premium", 0), ("b", "standard", 1), ("c", "free", 2))}
    policy = EnginePolicy.model_validate({"pool": "default/demo-pool", "model": "m",
                                          "capacityBlocks": 1000, "tenants": tenants})
    queue = AdmissionQueue(Ledger(), clock=time.monotonic)
    queue.set_policy(policy)
    signals = PickerSignals(SignalSources(
        active=lambda: SimpleNamespace(policy=policy),
        stats=lambda: None, view=queue.view, queue=queue))
    text = signals.exposition().decode()
    return [(s.name, s.labels) for f in text_string_to_metric_families(text)
            for s in f.samples]


def _args(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(arg.split("=", 1) for arg in container["args"])


def _picker(objects: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    """The EPP Deployment behind the pool's endpointPickerRef Service."""
    ref = one(objects, "InferencePool", pool)["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    deployments = [o for o in objects if o["kind"] == "Deployment" and all(
        o["spec"]["template"]["metadata"]["labels"].get(k) == v
        for k, v in service["spec"]["selector"].items())]
    assert len(deployments) == 1
    return deployments[0]


@pytest.mark.parametrize(("pool", "tier"), PICKERS.items())
def test_each_picker_reads_series_the_sidecar_serves(pool: str, tier: str) -> None:
    objects = build(EXAMPLE)
    args = _args(_picker(objects, pool))
    assert args["--pool-name"] == pool
    served = _served()
    for flag in METRIC_FLAGS:
        name, labels = _metric_spec(args[flag])
        assert name.startswith("kvquota:") and labels == {"tier": tier}
        matches = [s for s in served if s[0] == name
                   and all(s[1].get(k) == v for k, v in labels.items())]
        assert len(matches) == 1, f"{flag}={args[flag]} matches {matches}"


def test_the_pools_scrape_and_route_to_the_sidecars_client_port() -> None:
    objects = build(EXAMPLE)
    engine = one(objects, "Deployment", "vllm-engine")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    (vllm,) = engine["spec"]["template"]["spec"]["containers"]
    (serving,) = [p["containerPort"] for p in vllm["ports"] if p["name"] == "http"]
    for pool in PICKERS:
        spec = one(objects, "InferencePool", pool)["spec"]
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
        # The serving port the webhook hands to the sidecar (vLLM moves to loopback);
        # never the admin port, which shows every tenant's usage.
        assert [p["number"] for p in spec["targetPorts"]] == [serving]
        assert serving != ADMIN_PORT


def test_a_leased_sessions_token_outweighs_the_prefix_scorer() -> None:
    objects = build(EXAMPLE)
    for pool in PICKERS:
        deployment = _picker(objects, pool)
        pod = deployment["spec"]["template"]["spec"]
        (mount,) = pod["containers"][0]["volumeMounts"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        path = _args(deployment)["--config-file"]
        assert path.startswith(mount["mountPath"] + "/")
        data = one(objects, "ConfigMap", volume["configMap"]["name"])["data"]
        config = yaml.safe_load(data[path.rsplit("/", 1)[1]])
        assert config["kind"] == "EndpointPickerConfig"
        declared = {p.get("name", p["type"]) for p in config["plugins"]}
        (profile,) = config["schedulingProfiles"]
        weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
        assert set(weights) <= declared
        assert weights["session-affinity-scorer"] > weights["prefix-cache-scorer"]
        assert {"queue-scorer", "kv-cache-utilization-scorer"} <= set(weights)


def test_premium_traffic_goes_through_the_premium_picker() -> None:
    route = one(build(EXAMPLE), "HTTPRoute", "demo-pool")
    backends = [(rule.get("matches", []), [b["name"] for b in rule["backendRefs"]])
                for rule in route["spec"]["rules"]]
    premium = [names for matches, names in backends
               if any(h.get("value") == "premium" for m in matches
                      for h in m.get("headers", []))]
    assert premium == [["demo-premium"]]
    assert ["demo-shared"] in [names for _, names in backends]
