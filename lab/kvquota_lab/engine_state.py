"""Does the free-tier burst hold the KV cache right now? Read from the engine's telemetry.

The demo sends a premium follow-up turn only once the burst really holds the cache, so
every follow-up meets the same situation on a fast or a slow machine. "Holds" means the
free tier has requests it could not place because it already has all the KV it may get:

- stock vLLM (no quota): vLLM's own `/metrics` report requests waiting while the cache
  is full (`vllm:num_requests_waiting` >= 1, `vllm:kv_cache_usage_perc` >= FULL_CACHE).
  Only the burst is in flight then, so a premium arrival queues behind it (FCFS).
- KVQuota: admission caps the free tier below a full cache, so it holds the cache when
  the sidecar would not admit another of its requests (`/kvquota/status`: the tier's
  reservations at its maxBlocks ceiling, at its concurrency limit, or at the watermark)
  and the engine runs the requests it admitted (the plugin's stats file), all but one
  that may be in transit.

Both also need free requests still held back (`pending`, counted by the load generator:
not streaming yet, whether waiting in the engine, queued in the sidecar or backing off
after a refusal).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from engine_sidecar.contract.names import STATUS_ROUTE
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.reclaim import watermark_floor
from engine_sidecar.contract.stats import EngineStats, SidecarStatus

# A request waits for KV only when the free blocks cannot take its next chunk. Below 90%
# usage there is room for two burst requests (31 blocks each of 640), so a request
# waiting then waits for the step's token budget, not for the cache.
FULL_CACHE = 0.90
# The plugin rewrites its stats file at least twice a second while the engine steps:
# older than two periods means the engine is not stepping (or the file is stale).
STATS_FRESH_SECONDS = 1.0

_METRIC = re.compile(
    r"^(vllm:kv_cache_usage_perc|vllm:num_requests_running|vllm:num_requests_waiting)"
    r"(?:\{[^}]*\})? (\S+)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class VllmLoad:
    """vLLM's own gauges (summed over engines; the demo runs one)."""

    kv_usage: float
    running: int
    waiting: int

    def describe(self) -> str:
        return (f"cache {self.kv_usage:.0%} full, {self.running} running, "
                f"{self.waiting} waiting")


def parse_vllm_metrics(text: str) -> VllmLoad:
    values: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    if "vllm:kv_cache_usage_perc" not in values:
        raise ValueError("vLLM /metrics has no vllm:kv_cache_usage_perc: was the engine "
                         "started with --disable-log-stats?")
    return VllmLoad(values["vllm:kv_cache_usage_perc"],
                    int(values.get("vllm:num_requests_running", 0)),
                    int(values.get("vllm:num_requests_waiting", 0)))


async def read_vllm_load(client: httpx.AsyncClient, engine_url: str) -> VllmLoad:
    resp = await client.get(f"{engine_url}/metrics", timeout=5.0)
    resp.raise_for_status()
    return parse_vllm_metrics(resp.text)


@dataclass(frozen=True)
class Hold:
    """How the burst held the cache when a premium turn was sent."""

    reason: str
    engine_waiting: int  # requests in vLLM's waiting queue: ahead of an FCFS arrival
    kv_usage: float


class BurstGauge(Protocol):
    async def holds(self, client: httpx.AsyncClient, pending: int,
                    unanswered: int) -> Hold | None:
        """A Hold if the burst holds the cache now. `pending`: the wave's requests that
        have not streamed a token; `unanswered`: those the server has not answered yet
        (it is still taking the wave in, unless it reports them queued)."""
        ...

    def last_seen(self) -> str:
        """What the last look saw, for a timeout message."""
        ...


class StockGauge:
    """Stock vLLM: requests waiting for KV in the engine while the cache is full."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self._last = "nothing read yet"

    async def holds(self, client: httpx.AsyncClient, pending: int,
                    unanswered: int) -> Hold | None:
        try:
            load = await read_vllm_load(client, self.engine_url)
        except (httpx.HTTPError, ValueError) as exc:
            self._last = f"vLLM /metrics unreadable: {exc}"
            return None
        self._last = (f"vLLM: {load.describe()}; {pending} free requests not placed, "
                      f"{unanswered} not taken in")
        # vLLM answers a request as soon as it accepts it, so an unanswered one has not
        # reached the engine's queue yet.
        if unanswered == 0 and pending and load.waiting >= 1 and load.kv_usage >= FULL_CACHE:
            return Hold(f"{load.waiting} requests waiting for KV, cache {load.kv_usage:.0%} "
                        "full", load.waiting, load.kv_usage)
        return None

    def last_seen(self) -> str:
        return self._last


class QuotaGauge:
    """KVQuota: the free tier at the most the sidecar admits, all of it in the engine."""

    def __init__(self, engine_url: str, sidecar_admin_url: str, stats_path: Path,
                 policy: EnginePolicy, free_tenant: str) -> None:
        self.engine_url, self.sidecar_admin_url = engine_url, sidecar_admin_url
        self.stats_path = stats_path
        self.policy = policy
        self.free = policy.tenants[free_tenant]
        self._last = "nothing read yet"

    async def holds(self, client: httpx.AsyncClient, pending: int,
                    unanswered: int) -> Hold | None:
        try:
            load = await read_vllm_load(client, self.engine_url)
            resp = await client.get(self.sidecar_admin_url + STATUS_ROUTE, timeout=5.0)
            resp.raise_for_status()
            status = SidecarStatus.model_validate_json(resp.content)
            queued = _queued(resp.json(), self.free.tenant_id)
            stats = EngineStats.model_validate_json(self.stats_path.read_bytes())
        except (httpx.HTTPError, OSError, ValueError) as exc:
            self._last = f"engine state unreadable: {exc}"
            return None
        tenant = status.tenants.get(self.free.tenant_id)
        inflight = tenant.usage.inflight if tenant else 0
        reserved = tenant.usage.reserved_blocks if tenant else 0
        engine = stats.tenants.get(self.free.tenant_id)
        fresh = time.time() - stats.timestamp <= STATS_FRESH_SECONDS
        running = engine.running if engine and fresh else 0
        held = engine.running_blocks if engine and fresh else 0
        ceiling = self._ceiling(status, inflight, reserved)
        cap = self.free.max_blocks_per_engine
        self._last = (f"sidecar: free tier {reserved}/{cap} blocks reserved "
                      f"for {inflight} requests; engine: {running} free requests running on "
                      f"{held} blocks{'' if fresh else ' (stats stale)'}, {load.describe()}; "
                      f"{pending} free requests not placed, {unanswered} not answered "
                      f"({queued} queued in the sidecar)")
        # Requests the sidecar has not answered and does not report queued are still
        # being taken in (authenticated, counted, decided), and admitted ones the engine
        # does not run yet are still on their way to it: a premium turn sent now would
        # wait behind that work, not behind the cache. The plugin's stats lag the
        # sidecar's ledger by up to half a second, about the time the free tier takes to
        # turn one of its requests over, so one admitted request may be in transit.
        in_transit = inflight - running
        if unanswered <= queued and pending and ceiling and running >= 1 and in_transit <= 1:
            return Hold(f"free tier at its {ceiling} ({reserved}/{self.free.max_blocks_per_engine} "
                        f"blocks for {inflight} requests, {running} running on {held} "
                        f"blocks), {pending} held back", load.waiting, load.kv_usage)
        return None

    def _ceiling(self, status: SidecarStatus, inflight: int, reserved: int) -> str | None:
        """Which limit keeps the sidecar from admitting another free request, if any."""
        if inflight == 0:
            return None
        per_request = math.ceil(reserved / inflight)  # the burst's prompts are alike
        limit = self.free.max_concurrent_requests
        if limit is not None and inflight >= limit:
            return "concurrency limit"
        if reserved + per_request > self.free.max_blocks_per_engine:
            return "block quota"
        floor = watermark_floor(self.policy.watermark, status.total_blocks)
        if status.total_blocks and status.free_blocks - per_request < floor:
            return "watermark"
        return None

    def last_seen(self) -> str:
        return self._last


def _queued(status: Any, tenant_id: str) -> int:
    """Requests of `tenant_id` waiting in the sidecar's admission queue, from
    `/kvquota/status` `tenants.<id>.usage.queued`; 0 from a sidecar without a queue
    (it refuses instead)."""
    tenant = status.get("tenants", {}).get(tenant_id) if isinstance(status, dict) else None
    usage = tenant.get("usage") if isinstance(tenant, dict) else None
    value = usage.get("queued", 0) if isinstance(usage, dict) else 0
    return value if isinstance(value, int) else 0
