"""The endpoint-picker example (manifests/examples/picker): one llm-d Router picker for
every tier, whose configuration names only plugins and parameters the pinned release
documents, maps series the sidecar really serves, runs one profile per tier, and
scrapes and routes to the port the sidecar owns."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.contract.names import ADMIN_PORT
from engine_sidecar.contract.policy import EnginePolicy, Tier
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.telemetry.picker_signals import (
    KV_USAGE,
    WAITING,
    PickerSignals,
    SignalSources,
)

from .conftest import REPO, build, one

EXAMPLE = "manifests/examples/picker"
POOL = "demo-router"
TIERS = [t.value for t in Tier]

# What llm-d Router v0.10.0 (llm-d/llm-d-router, tag v0.10.0, commit 71f4f09,
# 2026-08-17) documents, per plugin type: its README under
# pkg/epp/framework/plugins/, its stability (cmd/epp/runner/runner.go: Alpha plugins
# load only with --allow-experimental-plugins), and every parameter it takes, as a
# dotted path (`[]` for a list's items), with the values an enumerated one accepts.
RELEASE = "v0.10.0"
IMAGE = f"ghcr.io/llm-d/llm-d-router-endpoint-picker:{RELEASE}"
ENGINE_CONFIG = {
    "engineConfigs[].name", "engineConfigs[].queuedRequestsSpec",
    "engineConfigs[].runningRequestsSpec", "engineConfigs[].kvUsageSpec",
    "engineConfigs[].loraSpec", "engineConfigs[].cacheInfoSpec",
    "engineConfigs[].cacheBlockSizeLabelName", "engineConfigs[].cacheNumBlocksLabelName",
    "engineConfigs[].cacheBlockSizeSpec", "engineConfigs[].cacheNumBlocksSpec",
    "engineConfigs[].customMetrics[].attributeKey",
    "engineConfigs[].customMetrics[].metricSpec",
}
DOCUMENTED: dict[str, dict[str, Any]] = {
    "metrics-data-source": {
        "doc": "datalayer/source/metrics/README.md", "alpha": False,
        "params": {"scheme", "path", "insecureSkipVerify", "caCertPath", "clientCertPath",
                   "clientKeyPath", "interval"}},
    "core-metrics-extractor": {
        "doc": "datalayer/extractor/metrics/README.md", "alpha": False,
        "params": {"engineLabelKey", "defaultEngine"} | ENGINE_CONFIG},
    "header-profile-handler": {
        "doc": "scheduling/profilehandler/headerprofile/README.md", "alpha": True,
        "params": {"headerName", "defaultProfile"}},
    "approx-prefix-cache-producer": {
        "doc": "requestcontrol/dataproducer/approximateprefix/README.md", "alpha": False,
        "params": {"autoTune", "blockSizeTokens", "maxPrefixBlocksToMatch",
                   "maxPrefixTokensToMatch", "lruCapacityPerServer"}},
    "prefix-cache-scorer": {
        "doc": "scheduling/scorer/prefix/README.md", "alpha": False,
        "params": {"matchLengthWeight", "matchLengthScaleTokens"}},
    "session-affinity-scorer": {
        "doc": "scheduling/scorer/sessionaffinity/README.md", "alpha": True,
        "params": {"strategy", "profileName", "encodedEndpointHeaderConfig.header",
                   "sessionIdConfig.sources[].header", "sessionIdConfig.sources[].attribute",
                   "sessionIdConfig.evictionTtlSeconds",
                   "sessionIdConfig.evictionSweepSeconds"},
        "values": {"strategy": {"encoded_endpoint_header", "session_id"}}},
    "max-score-picker": {
        "doc": "scheduling/picker/maxscore/README.md", "alpha": False,
        "params": {"maxNumOfEndpoints"}},
    "endpoint-attribute-filter": {
        "doc": "scheduling/filter/endpointattribute/README.md", "alpha": True,
        "params": {"attribute", "onMissing", "fallbackOnEmpty", "algorithm.type",
                   "algorithm.threshold.operator", "algorithm.threshold.value"},
        "values": {"onMissing": {"Pass", "Fail"}, "algorithm.type": {"threshold"},
                   "algorithm.threshold.operator": {
                       "LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual",
                       "Equal", "NotEqual"}}},
    "queue-scorer": {
        "doc": "scheduling/scorer/queuedepth/README.md", "alpha": False, "params": set()},
    "kv-cache-utilization-scorer": {
        "doc": "scheduling/scorer/kvcacheutilization/README.md", "alpha": False,
        "params": set()},
    "endpoint-attribute-scorer": {
        "doc": "scheduling/scorer/endpointattribute/README.md", "alpha": True,
        "params": {"attributeKey", "algorithm.type", "algorithm.normalization.adaptiveRange",
                   "algorithm.normalization.fixedRange.min",
                   "algorithm.normalization.fixedRange.max"},
        "values": {"algorithm.type": {"linear_lower_is_better", "linear_higher_is_better"}}},
}
# The config file's own schema (apix/config/v1alpha1/endpointpickerconfig_types.go).
CONFIG_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
               "dataLayer", "flowControl", "requestHandler"}


def _paths(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a parameters object as a dotted path (list items as `[]`); an empty
    object (`adaptiveRange: {}`) is a leaf too."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_paths(item, f"{prefix}.{key}" if prefix else key))
        return out
    if isinstance(value, list):
        out = {}
        for item in value:
            out.update(_paths(item, f"{prefix}[]"))
        return out
    return {prefix: value}


def _config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The EndpointPickerConfig the picker Deployment reads, from its mounted ConfigMap."""
    deployment = _picker(objects)
    pod = deployment["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    path = _args(deployment)["--config-file"]
    assert path.startswith(mount["mountPath"] + "/")
    data = one(objects, "ConfigMap", volume["configMap"]["name"])["data"]
    config: dict[str, Any] = yaml.safe_load(data[path.rsplit("/", 1)[1]])
    return config


def _args(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [arg.split("=", 1) for arg in container["args"]]
    return {arg[0]: arg[1] if len(arg) > 1 else "" for arg in args}


def _picker(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The picker Deployment behind the pool's endpointPickerRef Service."""
    ref = one(objects, "InferencePool", POOL)["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    deployments = [o for o in objects if o["kind"] == "Deployment" and all(
        o["spec"]["template"]["metadata"]["labels"].get(k) == v
        for k, v in service["spec"]["selector"].items())]
    assert len(deployments) == 1
    return deployments[0]


def _plugins(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p.get("name", p["type"]): p for p in config["plugins"]}


def test_the_config_names_only_what_the_pinned_release_documents() -> None:
    objects = build(EXAMPLE)
    config = _config(objects)
    assert set(config) <= CONFIG_KEYS
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    undocumented = []
    for name, plugin in _plugins(config).items():
        documented = DOCUMENTED.get(plugin["type"])
        if documented is None:
            undocumented.append(f"{name}: plugin type {plugin['type']}")
            continue
        params = plugin.get("parameters") or {}
        for path, value in (_paths(params) if params else {}).items():
            if path not in documented["params"]:
                undocumented.append(f"{name}: parameter {path}")
            elif value not in documented.get("values", {}).get(path, {value}):
                undocumented.append(f"{name}: {path}={value}")
    assert undocumented == []
    # The image is the release the list was written from, and it may load the Alpha
    # plugins the config names.
    deployment = _picker(objects)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == IMAGE
    if any(DOCUMENTED[p["type"]]["alpha"] for p in config["plugins"]):
        assert "--allow-experimental-plugins" in _args(deployment)
    assert _args(deployment)["--pool-name"] == POOL


def test_the_documented_list_is_complete_enough_to_catch_a_typo() -> None:
    """Guards the check above: a misspelt parameter is not in the list."""
    assert "fallbackOnEmty" not in DOCUMENTED["endpoint-attribute-filter"]["params"]
    assert _paths({"algorithm": {"threshold": {"operator": "LessThan", "value": 0.8}}}) == {
        "algorithm.threshold.operator": "LessThan", "algorithm.threshold.value": 0.8}


def test_the_twin_models_only_what_the_release_documents() -> None:
    """The pool twin's router (lab/kvquota_lab/bench/picker_config.py) refuses a config
    naming anything outside its list; its list is the release's, or a part of it."""
    from kvquota_lab.bench.picker_config import MODELLED

    assert set(MODELLED) <= set(DOCUMENTED)
    for kind, params in MODELLED.items():
        assert params <= DOCUMENTED[kind]["params"], kind


def test_every_profile_and_data_source_refers_to_a_declared_plugin() -> None:
    config = _config(build(EXAMPLE))
    declared = _plugins(config)
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"]
            for p in profile["plugins"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"]] + [e["pluginRef"] for e in source["extractors"]]
    assert set(refs) <= set(declared)


def _metric_spec(text: str) -> tuple[str, dict[str, str]]:
    """A metric spec as the release's core-metrics-extractor parses it (spec.go:
    `name` or `name{label=value,...}`, a value quoted or not)."""
    name, brace, rest = text.strip().partition("{")
    labels: dict[str, str] = {}
    if brace:
        assert rest.endswith("}"), text
        for pair in rest[:-1].split(","):
            key, _, value = pair.strip().partition("=")
            assert key and value, text
            labels[key.strip()] = value.strip().strip('"')
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


def _attributes(config: dict[str, Any]) -> dict[str, str]:
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    # Engine pods are vLLM's: labelled vllm, or unlabelled (the default engine).
    assert engine["name"] == extractor["parameters"].get("defaultEngine", "vllm") == "vllm"
    return {m["attributeKey"]: m["metricSpec"] for m in engine["customMetrics"]}


def test_each_tiers_attributes_read_one_series_the_sidecar_serves() -> None:
    attributes = _attributes(_config(build(EXAMPLE)))
    served = _served()
    for key, spec in attributes.items():
        name, labels = _metric_spec(spec)
        matches = [s for s in served if s[0] == name
                   and all(s[1].get(k) == v for k, v in labels.items())]
        assert len(matches) == 1, f"{key}: {spec} matches {matches}"
    specs = {(name, tuple(labels.items()))
             for name, labels in map(_metric_spec, attributes.values())}
    assert specs == {(series, (("tier", tier),)) for series in (WAITING, KV_USAGE)
                     for tier in TIERS}


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_has_a_profile_that_filters_and_scores_on_its_own_series(tier: str) -> None:
    config = _config(build(EXAMPLE))
    plugins = _plugins(config)
    attributes = _attributes(config)
    (handler,) = [p for p in config["plugins"] if p["type"] == "header-profile-handler"]
    assert handler["parameters"]["headerName"] == "x-kvquota-tier"
    profiles = {p["name"]: p["plugins"] for p in config["schedulingProfiles"]}
    assert set(profiles) == set(TIERS)
    assert handler["parameters"]["defaultProfile"] in profiles
    refs = profiles[tier]
    kinds = [plugins[r["pluginRef"]]["type"] for r in refs]
    # Filters run before scorers whatever the order, one after the other in the
    # profile's order; each is on the tier's KV series, absolute, never leaving a
    # request without a pod, the loosest first (a later one narrows what it kept).
    kv_filters = [plugins[r["pluginRef"]] for r in refs
                  if plugins[r["pluginRef"]]["type"] == "endpoint-attribute-filter"]
    assert kv_filters
    values = []
    for kv_filter in kv_filters:
        params = kv_filter["parameters"]
        assert _metric_spec(attributes[params["attribute"]]) == (KV_USAGE, {"tier": tier})
        assert params["fallbackOnEmpty"] is True
        assert params["algorithm"]["threshold"]["operator"] == "LessThan"
        assert 0 < params["algorithm"]["threshold"]["value"] < 1
        values.append(params["algorithm"]["threshold"]["value"])
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    weights: dict[str, float] = {}
    for ref in refs:
        plugin = plugins[ref["pluginRef"]]
        if "weight" not in ref:
            continue
        key = plugin["type"]
        if key == "endpoint-attribute-scorer":
            key, labels = _metric_spec(attributes[plugin["parameters"]["attributeKey"]])
            assert labels == {"tier": tier}
        weights[key] = ref["weight"]
    # A leased session's token outweighs the prefix scorer; the tier's queue and KV
    # series are scored too.
    assert weights["session-affinity-scorer"] > weights["prefix-cache-scorer"] > 0
    assert weights[WAITING] > 0 and weights[KV_USAGE] > 0
    assert kinds[-1] == "max-score-picker"


def test_the_pool_scrapes_and_routes_to_the_sidecars_client_port() -> None:
    objects = build(EXAMPLE)
    engine = one(objects, "Deployment", "vllm-engine")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    (vllm,) = engine["spec"]["template"]["spec"]["containers"]
    (serving,) = [p["containerPort"] for p in vllm["ports"] if p["name"] == "http"]
    spec = one(objects, "InferencePool", POOL)["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    # The serving port the webhook hands to the sidecar (vLLM moves to loopback);
    # never the admin port, which shows every tenant's usage.
    assert [p["number"] for p in spec["targetPorts"]] == [serving]
    assert serving != ADMIN_PORT


def test_every_request_goes_to_the_one_pool() -> None:
    route = one(build(EXAMPLE), "HTTPRoute", "demo-pool")
    backends = [b["name"] for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [POOL]


def test_the_twin_reads_the_file_the_configmap_is_made_of() -> None:
    """The pool twin builds its router from the shipped config
    (lab/kvquota_lab/bench/picker_config.py): the same bytes the picker mounts."""
    from kvquota_lab.bench.picker_config import SHIPPED_CONFIG

    config = _config(build(EXAMPLE))
    assert yaml.safe_load(SHIPPED_CONFIG.read_text()) == config
    assert SHIPPED_CONFIG.resolve() == (REPO / EXAMPLE / "epp-config.yaml").resolve()
