"""When does the free burst hold the cache? Read from stand-in telemetry: vLLM's
/metrics, the sidecar's /kvquota/status and the plugin's stats file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy, Tier
from kvquota_lab.engine_state import QuotaGauge, StockGauge, parse_vllm_metrics

ENGINE, SIDECAR = "http://engine", "http://sidecar"


def _metrics(usage: float, running: int, waiting: int) -> str:
    labels = '{engine="0",model_name="tiny"}'
    return (f"# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
            f"vllm:kv_cache_usage_perc{labels} {usage}\n"
            f"vllm:num_requests_running{labels} {running}.0\n"
            f"vllm:num_requests_waiting{labels} {waiting}.0\n"
            f'vllm:num_requests_waiting_by_reason{{reason="capacity"}} 99.0\n')


def _client(routes: dict[str, object]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        body = routes[str(request.url)]
        if isinstance(body, str):
            return httpx.Response(200, text=body)
        return httpx.Response(200, json=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def test_vllm_gauges_are_read_and_a_missing_one_says_why() -> None:
    load = parse_vllm_metrics(_metrics(0.97, 20, 12))
    assert (load.kv_usage, load.running, load.waiting) == (0.97, 20, 12)
    with pytest.raises(ValueError, match="--disable-log-stats"):
        parse_vllm_metrics("# nothing here\n")


@pytest.mark.parametrize(("usage", "waiting", "unanswered", "holds"), [
    (0.99, 12, 0, True),   # the cache is full and requests wait for it
    (0.60, 12, 0, False),  # requests wait for the step's token budget, not for KV
    (0.99, 0, 0, False),   # everything fits
    (0.99, 12, 5, False),  # vLLM is still taking the wave in
])
async def test_stock_holds_when_requests_wait_for_a_full_cache(
    usage: float, waiting: int, unanswered: int, holds: bool
) -> None:
    async with _client({f"{ENGINE}/metrics": _metrics(usage, 20, waiting)}) as client:
        hold = await StockGauge(ENGINE).holds(client, pending=12, unanswered=unanswered)
    assert (hold is not None) is holds
    if hold:
        assert hold.engine_waiting == 12 and "12 requests waiting for KV" in hold.reason


def _policy() -> EnginePolicy:
    free = TenantPolicy(tenant_id="hobbyist", tier=Tier.FREE, priority=2, guaranteed_blocks=0,
                        max_blocks_per_engine=160, max_tokens=64, default_max_tokens=32,
                        max_concurrent_requests=8)
    return EnginePolicy(pool="default/demo", model="tiny", block_size=32, tenants={
        "hobbyist": free})


def _status(reserved: int, inflight: int, queued: int | None = None) -> dict[str, object]:
    usage: dict[str, object] = {"reservedBlocks": reserved, "inflight": inflight}
    if queued is not None:
        usage["queued"] = queued
    return {"ready": True, "totalBlocks": 640, "freeBlocks": 400,
            "tenants": {"hobbyist": {"usage": usage}}}


def _stats(path: Path, running: int, age: float = 0.0) -> Path:
    path.write_text(json.dumps({"timestamp": time.time() - age, "tenants": {
        "hobbyist": {"running": running, "runningBlocks": 29 * running}}}))
    return path


@pytest.mark.parametrize(("reserved", "inflight", "running", "age", "holds"), [
    (155, 5, 5, 0.0, True),    # at its 160-block quota, its requests in the engine
    (124, 4, 4, 0.0, False),   # room for one more 31-block request: not at its ceiling
    (155, 5, 4, 0.0, True),    # one admitted request still on its way to the engine
    (155, 5, 1, 0.0, False),   # admitted, but the engine has not taken most of it in
    (155, 5, 0, 0.0, False),   # admitted, but nothing of it runs in the engine yet
    (155, 5, 5, 30.0, False),  # the plugin's stats are stale: the engine is not stepping
])
async def test_kvquota_holds_when_the_free_tier_is_at_its_ceiling_in_the_engine(
    tmp_path: Path, reserved: int, inflight: int, running: int, age: float, holds: bool
) -> None:
    routes = {f"{ENGINE}/metrics": _metrics(0.4, running, 0),
              f"{SIDECAR}/kvquota/status": _status(reserved, inflight)}
    gauge = QuotaGauge(ENGINE, SIDECAR, _stats(tmp_path / "stats.json", running, age),
                       _policy(), "hobbyist")
    async with _client(routes) as client:
        hold = await gauge.holds(client, pending=40, unanswered=0)
    assert (hold is not None) is holds, gauge.last_seen()


async def test_kvquota_counts_requests_queued_in_the_sidecar_as_held_back(
    tmp_path: Path
) -> None:
    """A sidecar that queues instead of refusing answers queued requests only when it
    admits them; it reports them in `usage.queued`."""
    stats = _stats(tmp_path / "stats.json", 5)
    gauge = QuotaGauge(ENGINE, SIDECAR, stats, _policy(), "hobbyist")
    for queued, holds in ((None, False), (40, True)):
        routes = {f"{ENGINE}/metrics": _metrics(0.4, 5, 0),
                  f"{SIDECAR}/kvquota/status": _status(155, 5, queued)}
        async with _client(routes) as client:
            hold = await gauge.holds(client, pending=40, unanswered=40)
        assert (hold is not None) is holds, gauge.last_seen()
