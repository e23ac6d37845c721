"""The pool twin's model of llm-d Router running a picker configuration.

`ConfiguredPicker` runs a `PickerConfig` (picker_config.py) the way the release does:
the request's tier header picks a scheduling profile (header-profile-handler); the
profile's filters drop engines by an attribute read from the engine's served series
(endpoint-attribute-filter, with its onMissing and fallbackOnEmpty); its scorers'
weighted sum ranks the rest and the highest wins (max-score-picker). The attributes are
the series the configuration's core-metrics-extractor maps (`customMetrics`), looked up
in what each engine serves (`EngineLoad.series`); an attribute no engine serves is
missing, as in the picker.

Scorers modelled:
- `prefix-cache-scorer` over the approx-prefix-cache-producer's index: chained hashes of
  the prompt's full blocks, blocks of `max(64, engine block size)` tokens with autoTune
  (the producer's floor), seeded by the model and the request's cache salt; an LRU per
  engine of the hashes routed there, as large as the engine's KV blocks; score = the
  matched share of the prompt's blocks (plus the match-length term when weighted);
- `session-affinity-scorer` (encoded_endpoint_header): 1 on the engine the request's
  session token names. The scorer also writes the token on every response, naming the
  pod it picked (over the value the sidecar set), so the token a client echoes names
  the engine its previous request went to (`PoolRun` keeps it);
- `queue-scorer`, `kv-cache-utilization-scorer` on the extractor's queue and KV specs;
- `endpoint-attribute-scorer`: linear in the attribute over the candidates' range (all
  equal: 1) or a fixed range; an engine missing it scores 0.

Ties go to the lowest engine index (the real picker shuffles them), so a run is
deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvquota_lab.bench.picker_config import MetricSpec, PickerConfig, Scorer
from kvquota_lab.bench.routers import EngineLoad, Lru, RouteRequest, SeriesKey, prefix_hashes


def resolve(series: Mapping[SeriesKey, float], spec: MetricSpec) -> float | None:
    """The value of the first served sample of the spec's metric carrying its labels."""
    if spec in series:
        return series[spec]
    name, labels = spec
    for (served, served_labels), value in series.items():
        if served == name and set(labels) <= set(served_labels):
            return value
    return None


class ConfiguredPicker:
    name = "prefix-affinity"

    def __init__(self, config: PickerConfig, engines: int, *, block_size: int,
                 capacity_blocks: int, model: str) -> None:
        self.config = config
        self.model = model
        self.block_size = config.prefix.block_size(block_size)
        self.max_blocks = config.prefix.max_blocks(self.block_size)
        capacity = config.prefix.lru_capacity(capacity_blocks)
        self._index = [Lru(capacity) for _ in range(engines)]

    def attribute(self, load: EngineLoad, key: str) -> float | None:
        spec = self.config.attributes.get(key)
        return resolve(load.series, spec) if spec is not None else None

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int:
        profile = self.config.profile_for(request.tier)
        candidates = list(range(len(loads)))
        for rule in profile.filters:
            kept = [i for i in candidates if rule.keeps(self.attribute(loads[i], rule.attribute))]
            if kept or not rule.fallback_on_empty:
                candidates = kept
        seed = f"{self.model}\0{request.salt or ''}"
        hashes = prefix_hashes(request.prompt, self.block_size, seed, self.max_blocks)
        totals = [0.0] * len(loads)
        for scorer in profile.scorers:
            for i, value in self._scores(scorer, request, hashes, loads, candidates).items():
                totals[i] += scorer.weight * value
        best = max(candidates, key=lambda i: (totals[i], -i))
        self._index[best].add(hashes)
        return best

    def _scores(self, scorer: Scorer, request: RouteRequest, hashes: list[bytes],
                loads: Sequence[EngineLoad], candidates: list[int]) -> dict[int, float]:
        kind = scorer.kind
        if kind == "session-affinity-scorer":
            return {i: 1.0 if i == request.token_engine else 0.0 for i in candidates}
        if kind == "prefix-cache-scorer":
            return {i: self._prefix_score(scorer, hashes, i) for i in candidates}
        if kind == "queue-scorer":
            queues = {i: resolve(loads[i].series, self.config.queue_spec) or 0.0
                      for i in candidates}
            return _linear(queues, lower_is_better=True, fixed=None)
        if kind == "kv-cache-utilization-scorer":
            return {i: 1.0 - (resolve(loads[i].series, self.config.kv_spec) or 0.0)
                    for i in candidates}
        assert scorer.attribute is not None
        values = {i: v for i in candidates
                  if (v := self.attribute(loads[i], scorer.attribute)) is not None}
        scores = _linear(values, lower_is_better=scorer.lower_is_better,
                         fixed=scorer.fixed_range)
        return {i: scores.get(i, 0.0) for i in candidates}

    def _prefix_score(self, scorer: Scorer, hashes: list[bytes], engine: int) -> float:
        if not hashes:
            return 0.0
        matched = 0
        for digest in hashes:
            if digest not in self._index[engine]:
                break
            matched += 1
        ratio = matched / len(hashes)
        if not scorer.match_length_weight:
            return ratio
        length = min(1.0, matched * self.block_size / scorer.match_length_scale_tokens) ** 2
        return scorer.match_length_weight * length + (1 - scorer.match_length_weight) * ratio


def _linear(values: Mapping[int, float], *, lower_is_better: bool,
            fixed: tuple[float, float] | None) -> dict[int, float]:
    """endpoint-attribute-scorer's (and queue-scorer's) normalization."""
    if not values:
        return {}
    low, high = fixed if fixed is not None else (min(values.values()), max(values.values()))
    if high <= low:
        return dict.fromkeys(values, 1.0)
    scores = {}
    for i, value in values.items():
        score = (min(max(value, low), high) - low) / (high - low)
        scores[i] = 1.0 - score if lower_is_better else score
    return scores
