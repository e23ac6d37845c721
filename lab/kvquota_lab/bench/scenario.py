"""Benchmark scenarios: tenants, their quotas, the load they send, for how long.

A scenario is a YAML file (the format is documented in `bench/README.md`). Loading
validates it completely before anything runs, so a typo or an impossible quota is
reported with its path in the file, not discovered minutes into a benchmark.

`generate_sessions()` turns a scenario into the same list of sessions every time for
the same seed. Every workload draws from its own random stream (seeded from the
scenario seed, the tenant id and the workload name), so removing the free tier for the
no-noise baseline leaves the premium sessions exactly as they were.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from engine_sidecar.contract import errors
from engine_sidecar.contract.policy import (
    DEFAULT_ABOVE_MAX,
    TENANT_ID_PATTERN,
    AboveMax,
    EnginePolicy,
    Isolation,
    Tier,
)
from kvquota.api import (
    InferencePoolSpec,
    KVCacheSpec,
    LeaseSpec,
    LimitsSpec,
    LocalObjectRef,
    PreemptionSpec,
    PrefixCacheSpec,
    TenantKVCacheSpec,
    TenantQuotaSpec,
    TiersSpec,
)

# Token ids the generator draws from: below 16 are the tiny model's special tokens,
# 2048 is its vocabulary, so the same prompts work on the CPU engine.
TOKEN_LOW, TOKEN_HIGH = 16, 2048
TIER_ORDER: tuple[Tier, ...] = (Tier.PREMIUM, Tier.STANDARD, Tier.FREE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the file and every bad field."""


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


# -- distributions ------------------------------------------------------------------


class _Dist(_Model):
    min: float | None = Field(None, description="Clamp draws below this.")
    max: float | None = Field(None, description="Clamp draws above this.")

    def _draw(self, rng: random.Random) -> float:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> float:
        value = self._draw(rng)
        if self.min is not None:
            value = max(value, self.min)
        if self.max is not None:
            value = min(value, self.max)
        return value

    def sample_int(self, rng: random.Random, floor: int = 0) -> int:
        return max(floor, round(self.sample(rng)))

    @model_validator(mode="after")
    def _check_clamp(self) -> _Dist:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class Constant(_Dist):
    dist: Literal["constant"] = "constant"
    value: float

    def _draw(self, rng: random.Random) -> float:
        return self.value


class Uniform(_Dist):
    dist: Literal["uniform"]
    low: float
    high: float

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self

    def _draw(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


class Normal(_Dist):
    dist: Literal["normal"]
    mean: float
    std: float = Field(ge=0)

    def _draw(self, rng: random.Random) -> float:
        return rng.gauss(self.mean, self.std)


class LogNormal(_Dist):
    """Long-tailed lengths: `median * exp(sigma * N(0, 1))`."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def _draw(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))


class Exponential(_Dist):
    dist: Literal["exponential"]
    mean: float = Field(gt=0)

    def _draw(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)


class Choice(_Dist):
    dist: Literal["choice"]
    values: list[float] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _weights_match(self) -> Choice:
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError(
                    f"weights has {len(self.weights)} entries, values has {len(self.values)}"
                )
            if any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
                raise ValueError("weights must be >= 0 with a positive sum")
        return self

    def _draw(self, rng: random.Random) -> float:
        return rng.choices(self.values, weights=self.weights)[0]


Distribution = Annotated[
    Constant | Uniform | Normal | LogNormal | Exponential | Choice,
    Field(discriminator="dist"),
]


def _number_is_constant(value: Any) -> Any:
    """`promptTokens: 500` means a constant 500."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"dist": "constant", "value": value}
    return value


# -- arrivals -----------------------------------------------------------------------


class _Arrival(_Model):
    start: float = Field(0.0, ge=0, description="Seconds into the run of the first arrival.")
    stop: float | None = Field(None, gt=0, description="No arrivals from here (default: "
                                                       "the scenario duration).")

    def times(self, rng: random.Random, duration: float) -> Iterator[float]:
        raise NotImplementedError

    def _end(self, duration: float) -> float:
        return min(self.stop, duration) if self.stop is not None else duration


class Poisson(_Arrival):
    """Independent arrivals at `rate` per second."""

    process: Literal["poisson"]
    rate: float = Field(gt=0)

    def times(self, rng: random.Random, duration: float) -> Iterator[float]:
        t, end = self.start, self._end(duration)
        while True:
            t += rng.expovariate(self.rate)
            if t >= end:
                return
            yield t


class Steady(_Arrival):
    """Evenly spaced arrivals at `rate` per second (no randomness)."""

    process: Literal["steady"]
    rate: float = Field(gt=0)

    def times(self, rng: random.Random, duration: float) -> Iterator[float]:
        end, step = self._end(duration), 1.0 / self.rate
        for i in range(math.ceil(max(0.0, end - self.start) * self.rate)):
            t = self.start + i * step
            if t < end:
                yield t


class Bursts(_Arrival):
    """`size` arrivals every `every` seconds, spread uniformly over `spread` seconds."""

    process: Literal["bursts"]
    every: float = Field(gt=0)
    size: int = Field(ge=1)
    spread: float = Field(0.0, ge=0)
    count: int | None = Field(None, ge=1, description="Number of bursts (default: until "
                                                      "the stop time).")

    def times(self, rng: random.Random, duration: float) -> Iterator[float]:
        end = self._end(duration)
        burst = 0
        while self.count is None or burst < self.count:
            at = self.start + burst * self.every
            if at >= end:
                return
            yield from sorted(at + rng.uniform(0.0, self.spread) for _ in range(self.size))
            burst += 1


Arrival = Annotated[Poisson | Steady | Bursts, Field(discriminator="process")]


# -- workloads, tenants, engine -----------------------------------------------------


class Workload(_Model):
    """Sessions of one kind. A session is one conversation: its first turn sends
    `promptTokens`; each later turn, `thinkTime` seconds after the previous answer,
    resends the whole conversation plus `turnTokens` new tokens."""

    arrival: Arrival = Field(description="When sessions start.")
    turns: Distribution = Field(default_factory=lambda: Constant(value=1))
    think_time: Distribution = Field(default_factory=lambda: Constant(value=0))
    prompt_tokens: Distribution
    shared_prefix_tokens: int = Field(
        0, ge=0, description="Leading tokens every session of this workload shares "
        "(a system prompt); part of promptTokens."
    )
    turn_tokens: Distribution = Field(default_factory=lambda: Constant(value=64))
    output_tokens: Distribution = Field(description="Tokens the model generates per turn.")
    max_tokens: int | None = Field(
        None, ge=1, description="max_tokens the client sends (omit: not sent, the tier's "
        "default applies under KVQuota)."
    )
    max_sessions: int | None = Field(None, ge=1)

    _coerce = field_validator(
        "turns", "think_time", "prompt_tokens", "turn_tokens", "output_tokens", mode="before"
    )(_number_is_constant)


def _blocks(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"{value}: a block count cannot be negative")
    if isinstance(value, str) and not _PERCENT.match(value):
        raise ValueError(f"{value!r}: give a block count or a percentage of "
                         "engine.capacityBlocks such as '25%'")
    return value


Blocks = int | str


class TenantLease(_Model):
    """`TenantQuota.spec.kvCache.lease`; `maxBlocks` may be a percentage too."""

    seconds: int | None = Field(None, ge=0, le=86_400, description="Overrides the tier's.")
    max_sessions: int | None = Field(None, ge=0)
    max_blocks: Blocks | None = None

    _check = field_validator("max_blocks", mode="before")(_blocks)

    def spec(self, capacity: int) -> LeaseSpec:
        return LeaseSpec(
            seconds=self.seconds,
            max_sessions=self.max_sessions,
            max_leased_blocks=None if self.max_blocks is None
            else resolve_blocks(self.max_blocks, capacity),
        )


class TenantKVCache(_Model):
    guaranteed_blocks: Blocks = Field(0, description="Blocks, or '25%' of capacity.")
    max_blocks: Blocks = Field(description="Blocks, or '50%' of capacity.")
    above_max: AboveMax = DEFAULT_ABOVE_MAX
    lease: TenantLease = Field(default_factory=TenantLease)

    _check = field_validator("guaranteed_blocks", "max_blocks", mode="before")(_blocks)


class Tenant(_Model):
    tier: Tier
    kv_cache: TenantKVCache
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    prefix_cache_isolation: Isolation = Isolation.TENANT
    workloads: dict[str, Workload] = Field(default_factory=dict)


class EngineSpec(_Model):
    capacity_blocks: int = Field(ge=16, description="KV blocks of one engine.")
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=16)
    max_model_len: int = Field(8192, ge=64)


class PoolSettings(_Model):
    watermark: float = Field(0.15, ge=0.0, lt=0.5)
    recompute_below_blocks: int = Field(128, ge=0)
    tiers: TiersSpec = Field(default_factory=TiersSpec)


class Clients(_Model):
    """How clients react to a refusal (429/503 carry Retry-After)."""

    max_attempts: int = Field(5, ge=1, description="1: never retry.")
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After the sidecar sends.")


class Slo(_Model):
    ttft: float = Field(gt=0, description="Seconds to the first token.")
    tpot: float = Field(gt=0, description="Seconds per output token after the first.")


class Baseline(_Model):
    """The no-noise reference run: the same scenario without these tiers' load."""

    drop_tiers: list[Tier] = Field(default_factory=lambda: [Tier.FREE])


class Scenario(_Model):
    name: str = Field(min_length=1, max_length=100)
    description: str = ""
    seed: int = 0
    duration: float = Field(gt=0, description="Seconds during which sessions start.")
    drain_timeout: float = Field(
        600.0, gt=0, description="Seconds after `duration` to let started work finish."
    )
    profile: str = Field("a100-llama3-8b", description="Step-cost profile for the twin.")
    engine: EngineSpec
    pool: PoolSettings = Field(default_factory=PoolSettings)
    tenants: dict[Annotated[str, Field(pattern=TENANT_ID_PATTERN, max_length=63)], Tenant] = (
        Field(min_length=1)
    )
    clients: Clients = Field(default_factory=Clients)
    slo: dict[Tier, Slo] = Field(default_factory=dict)
    baseline: Baseline = Field(default_factory=Baseline)

    @model_validator(mode="after")
    def _quotas_fit(self) -> Scenario:
        capacity = self.engine.capacity_blocks
        guaranteed = 0
        for tenant_id, tenant in self.tenants.items():
            g = resolve_blocks(tenant.kv_cache.guaranteed_blocks, capacity)
            m = resolve_blocks(tenant.kv_cache.max_blocks, capacity)
            if m < g:
                raise ValueError(f"tenants.{tenant_id}.kvCache: maxBlocks ({m}) must be >= "
                                 f"guaranteedBlocks ({g})")
            guaranteed += g
            for name, workload in tenant.workloads.items():
                if workload.shared_prefix_tokens >= self.engine.max_model_len:
                    raise ValueError(f"tenants.{tenant_id}.workloads.{name}.sharedPrefixTokens "
                                     "must be below engine.maxModelLen")
        fits = math.floor(capacity * (1 - self.pool.watermark))
        if guaranteed > fits:
            raise ValueError(
                f"the tenants' guaranteedBlocks add up to {guaranteed}, more than "
                f"capacityBlocks x (1 - watermark) = {fits}; the operator would not accept "
                "all of them. Lower the guarantees or raise engine.capacityBlocks."
            )
        if not any(t.workloads for t in self.tenants.values()):
            raise ValueError("no tenant has a workload: nothing to run")
        return self

    # -- derived ----------------------------------------------------------------

    def tier_of(self, tenant_id: str) -> Tier:
        return self.tenants[tenant_id].tier

    @cached_property
    def tiers(self) -> list[Tier]:
        present = {t.tier for t in self.tenants.values() if t.workloads}
        return [tier for tier in TIER_ORDER if tier in present]

    def without_tiers(self, tiers: list[Tier]) -> Scenario:
        """The same scenario with the load of `tiers` removed (quotas kept)."""
        tenants = {
            tid: t.model_copy(update={"workloads": {}}) if t.tier in tiers else t
            for tid, t in self.tenants.items()
        }
        return self.model_copy(update={"tenants": tenants})

    def engine_policy(self) -> EnginePolicy:
        """The EnginePolicy the operator would render for these tenants on one engine."""
        from kvquota.policy.render import render_policy
        from kvquota.policy.resolve import resolve_tenant, tenant_policy

        pool = InferencePoolSpec(
            gateway_pool_ref=LocalObjectRef(name="bench"),
            model="bench",
            kv_cache=KVCacheSpec(
                block_size=self.engine.block_size, watermark=self.pool.watermark
            ),
            tiers=self.pool.tiers,
            preemption=PreemptionSpec(recompute_below_blocks=self.pool.recompute_below_blocks),
        )
        policies = []
        capacity = self.engine.capacity_blocks
        for tenant_id, tenant in self.tenants.items():
            spec = TenantQuotaSpec(
                tenant_id=tenant_id,
                pool_ref=LocalObjectRef(name="bench"),
                tier=tenant.tier,
                kv_cache=TenantKVCacheSpec(
                    guaranteed_blocks=resolve_blocks(tenant.kv_cache.guaranteed_blocks, capacity),
                    max_blocks=resolve_blocks(tenant.kv_cache.max_blocks, capacity),
                    above_max=tenant.kv_cache.above_max,
                    lease=tenant.kv_cache.lease.spec(capacity),
                ),
                limits=tenant.limits,
                prefix_cache=PrefixCacheSpec(isolation=tenant.prefix_cache_isolation),
            )
            resolved = resolve_tenant(pool, spec, tenant_id=tenant_id, replicas=1)
            policies.append(tenant_policy(resolved))
        return render_policy("bench", self.name, pool, policies, replicas=1)


def resolve_blocks(value: Blocks, capacity: int) -> int:
    if isinstance(value, int):
        return value
    match = _PERCENT.match(value)
    assert match is not None  # validated on load
    return math.floor(capacity * float(match.group(1)) / 100.0)


# -- loading ------------------------------------------------------------------------


def shipped_scenarios() -> dict[str, str]:
    """name -> one-line description of the scenarios that ship with kvquota."""
    found = {}
    for entry in sorted(resources.files("kvquota_lab.bench").joinpath("scenarios").iterdir(),
                        key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            raw = yaml.safe_load(entry.read_text())
            found[entry.name.removesuffix(".yaml")] = " ".join(
                str(raw.get("description", "")).split()
            )
    return found


def _read(name_or_path: str) -> tuple[str, str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ScenarioError(f"scenario file {path} does not exist")
        return str(path), path.read_text()
    entry = resources.files("kvquota_lab.bench").joinpath("scenarios", f"{name_or_path}.yaml")
    if not entry.is_file():
        names = ", ".join(shipped_scenarios())
        raise ScenarioError(
            f"no scenario named {name_or_path!r}; shipped: {names}; or give a YAML file path"
        )
    return f"{name_or_path} (shipped)", entry.read_text()


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge; a distribution or an arrival process (a mapping with `dist` or
    `process`) replaces the one it overrides instead of merging into it."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        whole = isinstance(value, Mapping) and ("dist" in value or "process" in value)
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and not whole:
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = errors.problems(exc, top="(top level)")
    return "\n  ".join([f"invalid scenario {source}:", *lines])


def parse_scenario(
    raw: str | Mapping[str, Any],
    *,
    source: str = "<scenario>",
    scale: str | None = None,
    seed: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Scenario:
    """Validate a scenario (YAML text or an already parsed mapping).

    `scale` applies the overrides under `scales.<name>` first, then `overrides` (a
    mapping as from `parse_overrides`); `seed` replaces the scenario's seed."""
    if isinstance(raw, str):
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"scenario {source} is not valid YAML: {exc}") from None
    else:
        data = copy.deepcopy(dict(raw))
    if not isinstance(data, dict):
        raise ScenarioError(f"scenario {source} must be a YAML mapping")
    scales = data.pop("scales", None) or {}
    if not isinstance(scales, dict):
        raise ScenarioError(f"scenario {source}: scales must map a name to overrides")
    if scale is not None:
        if scale not in scales:
            known = ", ".join(sorted(scales)) or "none"
            raise ScenarioError(f"scenario {source} has no scale {scale!r} (scales: {known})")
        if not isinstance(scales[scale], dict):
            raise ScenarioError(f"scenario {source}: scales.{scale} must be a mapping")
        data = _merge(data, scales[scale])
    if overrides:
        data = _merge(data, overrides)
    if seed is not None:
        data["seed"] = seed
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_format_errors(source, exc)) from None


def load_scenario(name_or_path: str, *, scale: str | None = None,
                  seed: int | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Scenario:
    """A shipped scenario by name, or a YAML file."""
    source, text = _read(name_or_path)
    return parse_scenario(text, source=source, scale=scale, seed=seed, overrides=overrides)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set pool.tiers.premium.reservation=Full` (repeatable) as a mapping to merge
    into a scenario: a setting compared without editing the YAML (the value is read
    as YAML: `3`, `0.2`, `"40%"`, `{seconds: 60}`)."""
    merged: dict[str, Any] = {}
    for item in items:
        path, sep, text = item.partition("=")
        keys = [k.strip() for k in path.split(".")]
        if not sep or not all(keys):
            raise ScenarioError(f"--set {item!r}: give PATH=VALUE, e.g. "
                                "pool.tiers.premium.reservation=Full")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"--set {item!r}: the value is not valid YAML: {exc}"
                                ) from None
        for key in reversed(keys):
            value = {key: value}
        merged = _merge(merged, value)
    return merged


def scenario_scales(name_or_path: str) -> list[str]:
    _, text = _read(name_or_path)
    data = yaml.safe_load(text)
    return sorted((data or {}).get("scales") or {}) if isinstance(data, dict) else []


# -- generation ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    new_tokens: int  # tokens the user adds (the first turn: the whole prompt)
    output_tokens: int  # tokens the model would generate before stopping
    think_time: float  # seconds between the previous answer and this turn (0 first)


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    tenant: str
    tier: Tier
    workload: str
    start: float
    turns: tuple[Turn, ...]
    max_tokens: int | None  # what the client sends
    shared_prefix_tokens: int
    token_seed: int
    prefix_seed: int

    def first_prompt(self) -> list[int]:
        prefix = _tokens(self.prefix_seed, self.shared_prefix_tokens)
        rest = self.turns[0].new_tokens - len(prefix)
        return prefix + _tokens(self.token_seed, rest)

    def new_tokens(self, turn: int) -> list[int]:
        """The user's tokens of a later turn (`turn` >= 1)."""
        return _tokens(self.token_seed + turn, self.turns[turn].new_tokens)


def _tokens(seed: int, count: int) -> list[int]:
    if count <= 0:
        return []
    import numpy as np

    return np.random.default_rng(seed).integers(TOKEN_LOW, TOKEN_HIGH, count).tolist()


def _stream_seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def generate_sessions(scenario: Scenario) -> list[Session]:
    """All sessions of the scenario, ordered by start time; the same for the same seed."""
    sessions: list[Session] = []
    max_len = scenario.engine.max_model_len
    for tenant_id, tenant in sorted(scenario.tenants.items()):
        for name, workload in sorted(tenant.workloads.items()):
            rng = random.Random(_stream_seed(scenario.seed, tenant_id, name))
            prefix_seed = _stream_seed(scenario.seed, tenant_id, name, "prefix")
            starts = workload.arrival.times(rng, scenario.duration)
            for index, start in enumerate(starts):
                if workload.max_sessions is not None and index >= workload.max_sessions:
                    break
                num_turns = workload.turns.sample_int(rng, floor=1)
                turns = []
                context = 0
                for k in range(num_turns):
                    if k == 0:
                        new = workload.prompt_tokens.sample_int(
                            rng, floor=workload.shared_prefix_tokens + 1
                        )
                        think = 0.0
                    else:
                        new = workload.turn_tokens.sample_int(rng, floor=1)
                        think = max(0.0, workload.think_time.sample(rng))
                    output = workload.output_tokens.sample_int(rng, floor=1)
                    if context + new + output > max_len:
                        break  # a real client would truncate; the session ends here
                    turns.append(Turn(new, output, think))
                    context += new + output
                if not turns:
                    continue
                sessions.append(Session(
                    session_id=f"{tenant_id}.{name}.{index}",
                    tenant=tenant_id,
                    tier=tenant.tier,
                    workload=name,
                    start=round(start, 6),
                    turns=tuple(turns),
                    max_tokens=workload.max_tokens,
                    shared_prefix_tokens=workload.shared_prefix_tokens,
                    token_seed=_stream_seed(scenario.seed, tenant_id, name, index) >> 8,
                    prefix_seed=prefix_seed >> 8,
                ))
    sessions.sort(key=lambda s: (s.start, s.session_id))
    return sessions
