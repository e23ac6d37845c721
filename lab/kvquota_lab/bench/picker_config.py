"""The endpoint picker's configuration, read the way the pool twin models it.

The twin's `prefix-affinity` router with KVQuota's signals is built from an llm-d Router
`EndpointPickerConfig` (by default the one the picker example ships,
manifests/examples/picker/epp-config.yaml, packaged beside this module): its profiles,
the filters and scorers in each with their weights and thresholds, the series its
metrics extractor maps to attributes, and the header that picks a profile. So what the
twin measures is the configuration users deploy, not a router written beside it.

`MODELLED` lists every plugin type and parameter the twin acts on; a configuration that
names anything else is refused (`PickerConfigError`) rather than silently run as
something it is not. Defaults are the pinned release's (v0.10.0; tests/manifests/
test_picker.py holds the release's documented list).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# A symlink to manifests/examples/picker/epp-config.yaml, so the wheel carries it too.
SHIPPED_CONFIG = Path(__file__).parent / "picker" / "epp-config.yaml"

_ENGINE = "engineConfigs[]."
MODELLED: dict[str, frozenset[str]] = {
    # The twin hands the extractor each engine's series as served, at every pick: no
    # scrape interval, no TLS.
    "metrics-data-source": frozenset(),
    # LoRA and the running count are read but nothing in the twin scores them; the cache
    # info gives the prefix producer the engine's block size and capacity.
    "core-metrics-extractor": frozenset({
        "defaultEngine", f"{_ENGINE}name", f"{_ENGINE}queuedRequestsSpec",
        f"{_ENGINE}runningRequestsSpec", f"{_ENGINE}kvUsageSpec", f"{_ENGINE}loraSpec",
        f"{_ENGINE}cacheInfoSpec", f"{_ENGINE}customMetrics[].attributeKey",
        f"{_ENGINE}customMetrics[].metricSpec"}),
    "header-profile-handler": frozenset({"headerName", "defaultProfile"}),
    "approx-prefix-cache-producer": frozenset({
        "autoTune", "blockSizeTokens", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch",
        "lruCapacityPerServer"}),
    "prefix-cache-scorer": frozenset({"matchLengthWeight", "matchLengthScaleTokens"}),
    # Either header name: the scorer writes the pod it picked on every response.
    "session-affinity-scorer": frozenset({"encodedEndpointHeaderConfig.header"}),
    "max-score-picker": frozenset(),
    "queue-scorer": frozenset(),
    "kv-cache-utilization-scorer": frozenset(),
    "endpoint-attribute-filter": frozenset({
        "attribute", "onMissing", "fallbackOnEmpty", "algorithm.type",
        "algorithm.threshold.operator", "algorithm.threshold.value"}),
    "endpoint-attribute-scorer": frozenset({
        "attributeKey", "algorithm.type", "algorithm.normalization.adaptiveRange",
        "algorithm.normalization.fixedRange.min", "algorithm.normalization.fixedRange.max"}),
}
SCORERS = frozenset({"prefix-cache-scorer", "session-affinity-scorer", "queue-scorer",
                     "kv-cache-utilization-scorer", "endpoint-attribute-scorer"})
OPERATORS = {
    "LessThan": float.__lt__, "LessThanOrEqual": float.__le__,
    "GreaterThan": float.__gt__, "GreaterThanOrEqual": float.__ge__,
    "Equal": float.__eq__, "NotEqual": float.__ne__,
}
# The release's vLLM engine config (core-metrics-extractor factories.go), used when the
# configuration does not replace it.
VLLM_QUEUE, VLLM_KV = "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
MIN_PREFIX_BLOCK_TOKENS = 64  # the producer's floor on its block size


class PickerConfigError(ValueError):
    """A configuration the twin cannot run as written."""


MetricSpec = tuple[str, tuple[tuple[str, str], ...]]  # name, sorted label pairs


def parse_metric_spec(text: str) -> MetricSpec:
    """`name` or `name{label=value,...}`, a value quoted or not (the extractor's
    syntax)."""
    name, brace, rest = text.strip().partition("{")
    labels: dict[str, str] = {}
    if brace:
        if not rest.endswith("}"):
            raise PickerConfigError(f"not a metric spec: {text!r}")
        for pair in filter(None, (p.strip() for p in rest[:-1].split(","))):
            key, equals, value = pair.partition("=")
            if not equals or not key.strip():
                raise PickerConfigError(f"invalid label pair {pair!r} in {text!r}")
            labels[key.strip()] = value.strip().strip('"')
    if not name.strip():
        raise PickerConfigError(f"not a metric spec: {text!r}")
    return name.strip(), tuple(sorted(labels.items()))


@dataclass(frozen=True)
class AttributeFilter:
    name: str
    attribute: str
    operator: str
    value: float
    keep_missing: bool  # onMissing: Pass
    fallback_on_empty: bool

    def keeps(self, value: float | None) -> bool:
        if value is None:
            return self.keep_missing
        return bool(OPERATORS[self.operator](float(value), float(self.value)))


@dataclass(frozen=True)
class Scorer:
    """One weighted scorer of a profile. `kind` is its plugin type; an attribute scorer
    also has its attribute, direction and fixed range (None: the candidates' range)."""

    name: str
    kind: str
    weight: float
    attribute: str | None = None
    lower_is_better: bool = True
    fixed_range: tuple[float, float] | None = None
    match_length_weight: float = 0.0
    match_length_scale_tokens: int = 8192


@dataclass(frozen=True)
class Profile:
    name: str
    filters: tuple[AttributeFilter, ...]
    scorers: tuple[Scorer, ...]


@dataclass(frozen=True)
class PrefixProducer:
    auto_tune: bool = True
    block_size_tokens: int = 16
    max_prefix_blocks: int = 2048
    max_prefix_tokens: int = 131072
    lru_capacity_per_server: int = 31250

    def block_size(self, engine_block_size: int) -> int:
        size = engine_block_size if self.auto_tune and engine_block_size > 0 else (
            self.block_size_tokens)
        return max(size, MIN_PREFIX_BLOCK_TOKENS)

    def max_blocks(self, block_size: int) -> int | None:
        """None: the whole prompt."""
        if self.max_prefix_tokens > 0:
            return self.max_prefix_tokens // block_size
        return self.max_prefix_blocks or None

    def lru_capacity(self, engine_capacity_blocks: int) -> int:
        if self.auto_tune and engine_capacity_blocks > 0:
            return engine_capacity_blocks
        return self.lru_capacity_per_server


@dataclass(frozen=True)
class PickerConfig:
    source: str
    header: str
    default_profile: str
    profiles: Mapping[str, Profile]
    attributes: Mapping[str, MetricSpec]  # customMetrics: attribute key -> series
    queue_spec: MetricSpec
    kv_spec: MetricSpec
    prefix: PrefixProducer = field(default_factory=PrefixProducer)

    def profile_for(self, header: str | None) -> Profile:
        """header-profile-handler: the profile the header names; the default one when
        it is absent; a name no profile has is refused, as the picker does."""
        if len(self.profiles) == 1:
            return next(iter(self.profiles.values()))
        name = header or self.default_profile
        if name not in self.profiles:
            raise PickerConfigError(f"{self.source}: no scheduling profile {name!r} for "
                                    f"header {self.header} (the picker answers 429)")
        return self.profiles[name]

    def with_threshold(self, value: float) -> PickerConfig:
        """Every KV filter's threshold set to `value` (`--picker-kv-filter`)."""
        profiles = {
            name: Profile(name, tuple(AttributeFilter(
                f.name, f.attribute, f.operator, value, f.keep_missing, f.fallback_on_empty)
                for f in profile.filters), profile.scorers)
            for name, profile in self.profiles.items()}
        return PickerConfig(self.source, self.header, self.default_profile, profiles,
                            self.attributes, self.queue_spec, self.kv_spec, self.prefix)


def _paths(value: Any, prefix: str = "") -> dict[str, Any]:
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


def load_picker_config(path: Path | None = None) -> PickerConfig:
    path = path or SHIPPED_CONFIG
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PickerConfigError(f"cannot read the picker config {path}: {exc}") from exc
    return parse_picker_config(document, source=str(path))


def parse_picker_config(document: Any, *, source: str = "<config>") -> PickerConfig:
    if not isinstance(document, dict) or document.get("kind") != "EndpointPickerConfig":
        raise PickerConfigError(f"{source}: not an EndpointPickerConfig")
    unmodelled = sorted(set(document) - {"apiVersion", "kind", "plugins",
                                         "schedulingProfiles", "dataLayer"})
    if unmodelled:
        raise PickerConfigError(f"{source}: the twin does not model {', '.join(unmodelled)}")
    plugins: dict[str, dict[str, Any]] = {}
    for plugin in document.get("plugins") or []:
        kind = plugin.get("type")
        name = plugin.get("name", kind)
        if kind not in MODELLED:
            raise PickerConfigError(f"{source}: the twin does not model plugin {kind!r}")
        params = plugin.get("parameters") or {}
        extra = sorted(set(_paths(params) if params else ()) - MODELLED[kind])
        if extra:
            raise PickerConfigError(f"{source}: the twin does not model {kind} parameter "
                                    f"{', '.join(extra)} ({name})")
        plugins[name] = {"type": kind, "parameters": params}
    by_type = {p["type"]: p["parameters"] for p in plugins.values()}

    handler = by_type.get("header-profile-handler", {})
    header = str(handler.get("headerName", "EPP-Profile")).lower()
    default_profile = str(handler.get("defaultProfile", "decode"))
    profiles = {}
    for profile in document.get("schedulingProfiles") or []:
        filters, scorers = [], []
        for ref in profile.get("plugins") or []:
            name = ref["pluginRef"]
            if name not in plugins:
                raise PickerConfigError(f"{source}: profile {profile['name']} names "
                                        f"undeclared plugin {name!r}")
            kind, params = plugins[name]["type"], plugins[name]["parameters"]
            if kind == "endpoint-attribute-filter":
                filters.append(_attribute_filter(name, params, source))
            elif kind in SCORERS:
                scorers.append(_scorer(name, kind, params, float(ref.get("weight", 1.0))))
        profiles[profile["name"]] = Profile(profile["name"], tuple(filters), tuple(scorers))
    if not profiles:
        raise PickerConfigError(f"{source}: no scheduling profile")
    if len(profiles) > 1 and "header-profile-handler" not in by_type:
        raise PickerConfigError(f"{source}: several profiles need header-profile-handler")

    extractor = by_type.get("core-metrics-extractor", {})
    engine_name = extractor.get("defaultEngine", "vllm")
    engine = next((e for e in extractor.get("engineConfigs") or []
                   if e.get("name") == engine_name), None)
    queue_spec, kv_spec, attributes = parse_metric_spec(VLLM_QUEUE), parse_metric_spec(VLLM_KV), {}
    if engine is not None:
        queue_spec = parse_metric_spec(engine.get("queuedRequestsSpec") or VLLM_QUEUE)
        kv_spec = parse_metric_spec(engine.get("kvUsageSpec") or VLLM_KV)
        attributes = {m["attributeKey"]: parse_metric_spec(m["metricSpec"])
                      for m in engine.get("customMetrics") or []}
    producer = by_type.get("approx-prefix-cache-producer", {})
    prefix = PrefixProducer(
        auto_tune=bool(producer.get("autoTune", True)),
        block_size_tokens=int(producer.get("blockSizeTokens", 16)),
        max_prefix_blocks=int(producer.get("maxPrefixBlocksToMatch", 2048)),
        max_prefix_tokens=int(producer.get("maxPrefixTokensToMatch", 131072)),
        lru_capacity_per_server=int(producer.get("lruCapacityPerServer", 31250)))
    return PickerConfig(source, header, default_profile, profiles, attributes, queue_spec,
                        kv_spec, prefix)


def _attribute_filter(name: str, params: Mapping[str, Any], source: str) -> AttributeFilter:
    algorithm = params.get("algorithm") or {}
    threshold = algorithm.get("threshold") or {}
    on_missing = params.get("onMissing", "Pass")
    if (algorithm.get("type") != "threshold" or threshold.get("operator") not in OPERATORS
            or on_missing not in ("Pass", "Fail") or "attribute" not in params
            or "value" not in threshold):
        raise PickerConfigError(f"{source}: filter {name}: needs attribute, algorithm.type "
                                "threshold, a threshold operator and value, onMissing "
                                "Pass or Fail")
    if not params.get("fallbackOnEmpty", False):
        # With every pod dropped the picker fails the request: not modelled.
        raise PickerConfigError(f"{source}: filter {name}: the twin models "
                                "fallbackOnEmpty: true only")
    return AttributeFilter(name, params["attribute"], threshold["operator"],
                           float(threshold["value"]), on_missing == "Pass",
                           bool(params.get("fallbackOnEmpty", False)))


def _scorer(name: str, kind: str, params: Mapping[str, Any], weight: float) -> Scorer:
    if kind == "endpoint-attribute-scorer":
        algorithm = params.get("algorithm") or {}
        fixed = (algorithm.get("normalization") or {}).get("fixedRange")
        return Scorer(name, kind, weight, attribute=params["attributeKey"],
                      lower_is_better=algorithm.get("type") != "linear_higher_is_better",
                      fixed_range=(float(fixed["min"]), float(fixed["max"])) if fixed else None)
    if kind == "prefix-cache-scorer":
        return Scorer(name, kind, weight,
                      match_length_weight=float(params.get("matchLengthWeight", 0.0)),
                      match_length_scale_tokens=int(params.get("matchLengthScaleTokens", 8192)))
    return Scorer(name, kind, weight)
