"""Router models for the pool twin: which engine a request goes to.

- `round-robin`: engines in turn (a plain Service).
- `least-kv`: the engine with the lowest KV-cache utilization, then the fewest waiting
  requests (the inference extension's kv-cache-utilization scorer alone).
- `prefix-affinity`: the endpoint picker. Reading KVQuota's series, it is llm-d Router
  running the shipped picker configuration (`picker_router.ConfiguredPicker`, built by
  `router_choice.make_router` from a `picker_config.PickerConfig`). Reading vLLM's series (stock
  engines, or `--picker-signals vllm`), it is `PrefixAffinity`, a model of the
  pickers' stock scorers: the prompt is cut into `blockSize`-token blocks; block i's
  hash chains block i's content with block i-1's hash, and the chain starts from the
  model and the request's cache salt (so a tenant whose prefix cache is isolated never
  matches another tenant's blocks, as on the engine). The router remembers, per engine,
  the hashes of requests it sent there (an LRU the size of the engine's KV cache); an
  engine's prefix score is the number of leading blocks it holds over the prompt's
  blocks. The picked engine maximizes `prefix x 2 + (1 - kv utilization) + queue
  score`, queue score being 1 - waiting / max waiting. A request that carries a
  session token (`RouteRequest.token_engine`) also scores `SESSION_WEIGHT` (3) on the
  engine it names. With `kv_filter` (`--picker-kv-filter`), engines whose KV series
  reads at least that are left out before scoring (all stay when none is below it).
- `session-affinity`: a session's next turn goes to the engine that served its
  previous turn (the engine holding its lease, as the sidecar's hint header names it);
  a first turn goes by `least-kv`.

What a router reads of an engine (`EngineLoad`) is what a real endpoint picker scrapes,
chosen by the pool's `signals` (`SIGNALS`, `kvquota bench --picker-signals`):

- `vllm`: vLLM's own series, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
  (the pickers' defaults). A request held in the KVQuota sidecar's admission queue is
  in neither: an engine whose sidecar queues looks idle.
- `kvquota`: KVQuota's per-tier series, `kvquota:num_requests_waiting{tier}` and
  `kvquota:kv_cache_usage_perc{tier}` (engine waiting plus sidecar queued, for T and
  the tiers served before it; how close a request of T is to not fitting), computed by
  the sidecar's own `picker_signals.tier_signals`; `EngineLoad.series` carries every
  tier's, which a configured picker maps to attributes. With these signals and a
  router other than the configured picker, the pool hands the router the session token
  the sidecar writes on a leased session's admitted responses
  (`gateway.admission.call_back.calls_back`; `RouteRequest.token_engine`).

Ties go to the lowest engine index, so a run is deterministic.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    pass

MAX_PREFIX_BLOCKS = 256  # the extension's default: longer prompts are matched this far
PREFIX_WEIGHT, KV_WEIGHT, QUEUE_WEIGHT = 2.0, 1.0, 1.0
SESSION_WEIGHT = 3.0  # the example picker configuration's session-affinity scorer
VLLM_SIGNALS, KVQUOTA_SIGNALS = "vllm", "kvquota"
SIGNALS = (VLLM_SIGNALS, KVQUOTA_SIGNALS)


@dataclass(frozen=True)
class RouteRequest:
    tenant: str
    session: str
    prompt: Sequence[int]
    salt: str | None  # the cache salt the sidecar sets (None: the shared cache)
    token_engine: int | None = None  # the engine its session token names (None: none)
    tier: str | None = None  # the tier header the client sends (None: none)


# A served sample: the metric's name and its label pairs, sorted.
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class EngineLoad:
    """What a router sees of an engine: the series its picker scrapes (`SIGNALS`)."""

    kv_usage: float  # 0..1: vllm:kv_cache_usage_perc, or kvquota's for the request's tier
    waiting: int  # vllm:num_requests_waiting (engine only), or kvquota's (+ sidecar queue)
    running: int  # vllm:num_requests_running
    # Every sample the engine serves to a picker (vLLM's, and KVQuota's per tier when a
    # sidecar is in front): what a configured picker's metrics extractor reads.
    series: Mapping[SeriesKey, float] = field(default_factory=dict)


class Router(Protocol):
    name: str

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int:
        index = self._next % len(loads)
        self._next += 1
        return index


def least_kv(loads: Sequence[EngineLoad]) -> int:
    return min(range(len(loads)),
               key=lambda i: (loads[i].kv_usage, loads[i].waiting, loads[i].running, i))


class LeastKv:
    name = "least-kv"

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int:
        return least_kv(loads)


class SessionAffinity:
    name = "session-affinity"

    def __init__(self) -> None:
        self._home: dict[str, int] = {}

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int:
        home = self._home.get(request.session)
        index = home if home is not None and home < len(loads) else least_kv(loads)
        self._home[request.session] = index
        return index


def prefix_hashes(prompt: Sequence[int], block_size: int, seed: str,
                  max_blocks: int | None = MAX_PREFIX_BLOCKS) -> list[bytes]:
    """Chained block hashes of the prompt's full blocks (at most `max_blocks`; None: all)."""
    hashes: list[bytes] = []
    previous = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    full = len(prompt) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    for i in range(full):
        block = prompt[i * block_size:(i + 1) * block_size]
        digest = hashlib.blake2b(previous, digest_size=8)
        digest.update(b",".join(str(t).encode() for t in block))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def add(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._entries[key] = None
            self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, engines: int, *, block_size: int, capacity_blocks: int,
                 model: str, kv_filter: float | None = None) -> None:
        self.block_size = block_size
        self.model = model
        self.kv_filter = kv_filter
        self._index = [Lru(capacity_blocks) for _ in range(engines)]

    def pick(self, request: RouteRequest, loads: Sequence[EngineLoad]) -> int:
        seed = f"{self.model}\0{request.salt or ''}"
        hashes = prefix_hashes(request.prompt, self.block_size, seed)
        max_waiting = max((load.waiting for load in loads), default=0)

        def score(i: int) -> float:
            matched = 0
            for digest in hashes:
                if digest not in self._index[i]:
                    break
                matched += 1
            prefix = matched / len(hashes) if hashes else 0.0
            queue = 1.0 - loads[i].waiting / max_waiting if max_waiting else 1.0
            session = SESSION_WEIGHT if i == request.token_engine else 0.0
            return (PREFIX_WEIGHT * prefix + KV_WEIGHT * (1.0 - loads[i].kv_usage)
                    + QUEUE_WEIGHT * queue + session)

        candidates: Sequence[int] = range(len(loads))
        if self.kv_filter is not None:
            candidates = [i for i in candidates if loads[i].kv_usage < self.kv_filter] or candidates
        best = max(candidates, key=lambda i: (score(i), -i))
        self._index[best].add(hashes)
        return best
