"""What an endpoint picker scraping the pod's serving port sees: vLLM's own series, and
beside them the sidecar's per-tier count of what the engine really has in front of it
(engine_sidecar/gateway/telemetry/picker_signals.py), agreeing with /kvquota/status while
requests are held in the admission queue."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.contract.names import UNCLASSIFIED
from engine_sidecar.contract.policy import Tier
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.telemetry.picker_signals import tier_signals

from .conftest import Harness, StubFactory
from .helpers import WAIT, Keys, http_get, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

WAITING = "kvquota:num_requests_waiting"
KV_USAGE = "kvquota:kv_cache_usage_perc"
TENANTS = {"acme": ("premium", 0), "globex": ("standard", 1), "initech": ("free", 2)}
QUEUED = {"acme": 1, "globex": 2, "initech": 3}  # held in the sidecar's queue
ENGINE_WAITING = {"acme": 1, "globex": 0, "initech": 4, UNCLASSIFIED: 2}
RUNNING_BLOCKS = {"initech": 50, UNCLASSIFIED: 10}  # in the engine (plugin stats)
TOTAL_BLOCKS = 1000
MAX_BLOCKS = 10_000  # every tenant's (`helpers.tenant`): the capacity binds first
WATERMARK_BLOCKS = 100  # `helpers.make_policy`'s watermark, 0.1 of TOTAL_BLOCKS


def _scrape(text: str) -> dict[tuple[str, str], float]:
    """Every sample of the scrape as one exposition, as a picker parses it."""
    return {(sample.name, sample.labels.get("tier", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _write_stats(path: Path) -> None:
    tenants = {t: TenantEngineStats(waiting=ENGINE_WAITING.get(t, 0),
                                    running_blocks=RUNNING_BLOCKS.get(t, 0))
               for t in ENGINE_WAITING}
    used = sum(RUNNING_BLOCKS.values())
    stats = EngineStats(
        timestamp=time.time() + 3600,  # fresh for as long as the test runs
        total_blocks=TOTAL_BLOCKS, free_blocks=TOTAL_BLOCKS - used, tenants=tenants)
    path.write_text(stats.model_dump_json(by_alias=True))


def _post(url: str, token: str) -> httpx.Response:
    return http_post(url + "/v1/completions",
                     json={"prompt": "x", "max_tokens": 1, "stream": True},
                     headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _held_queue(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: Path
) -> tuple[Harness, StubEngine, list[threading.Thread]]:
    """Three tiers, one request of each streaming and holding its tenant's only slot,
    `QUEUED` more waiting behind them in the sidecar; the engine's stats say
    `ENGINE_WAITING` wait inside it."""
    stats_path = tmp_path / "engine-stats.json"
    _write_stats(stats_path)
    harness, stub = stub_sidecar(StubEngine(hold=threading.Event()), stats_path=stats_path)
    harness.apply(make_policy(*(
        tenant(t, tier=tier, priority=priority, max_concurrent_requests=1)
        for t, (tier, priority) in TENANTS.items())))
    threads: list[threading.Thread] = []

    def send(tenant_id: str) -> None:
        token = keys.hs(tenant_id)
        thread = threading.Thread(target=lambda: _post(harness.url, token), daemon=True)
        thread.start()
        threads.append(thread)

    for tenant_id in TENANTS:
        send(tenant_id)
    wait_for(lambda: stub.active == len(TENANTS), WAIT, "the first requests never ran")
    for tenant_id, count in QUEUED.items():
        for _ in range(count):
            send(tenant_id)
    queue = harness.gateway.queue
    wait_for(lambda: all(queue.depth(t) == n for t, n in QUEUED.items()), WAIT,
             "the requests never queued")
    return harness, stub, threads


def test_the_pods_scrape_counts_the_admission_queue_per_tier_as_status_does(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: Path
) -> None:
    harness, stub, threads = _held_queue(stub_sidecar, keys, tmp_path)
    try:
        scrape = http_get(harness.url + "/metrics", timeout=30)
        status = http_get(harness.admin_url + "/kvquota/status", timeout=30).json()
    finally:
        stub.release()
        for thread in threads:
            thread.join(60)
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    series = _scrape(scrape.text)  # one exposition: vLLM's series, then the sidecar's
    assert series[("vllm:num_requests_waiting", "")] == 7.0  # vLLM's own, untouched
    assert stub.scrape_headers[-1]["accept"].startswith("text/plain")

    usage = {t: status["tenants"][t]["usage"] for t in TENANTS}
    total = status["totalBlocks"]
    assert total == TOTAL_BLOCKS
    for tier in Tier:
        priority = next(p for t, p in TENANTS.values() if t == tier.value)
        ahead = [t for t, (_, p) in TENANTS.items() if p <= priority]
        # Waiting: what the tier waits behind, in the sidecar's queue and the engine's.
        assert series[(WAITING, tier.value)] == sum(
            usage[t]["queued"] + ENGINE_WAITING[t] for t in ahead)
        # KV: what the tiers ahead hold (or reserved, where more) and the tier itself is
        # charged, over the capacity above the watermark (no tenant has a guarantee, and
        # each one's maxBlocks is above capacity here).
        before = sum(max(usage[t]["blocks"], usage[t]["reservedBlocks"])
                     for t, (_, p) in TENANTS.items() if p < priority)
        own = [t for t, (name, _) in TENANTS.items() if name == tier.value]
        charged = sum(usage[t]["chargedBlocks"] for t in own)
        assert series[(KV_USAGE, tier.value)] == round(
            (before + charged) / (total - WATERMARK_BLOCKS), 6)
    assert series[(WAITING, "all")] == sum(u["queued"] for u in usage.values()) + sum(
        ENGINE_WAITING.values())
    assert series[(KV_USAGE, "all")] == round(1 - status["freeBlocks"] / total, 6)

    # As designed: premium sees its own queue, not the free tier's backlog it overtakes,
    # nor unclassified traffic's blocks (the first the engine takes back).
    assert series[(WAITING, "premium")] == QUEUED["acme"] + ENGINE_WAITING["acme"] == 2
    assert series[(WAITING, "standard")] == 4
    assert series[(WAITING, "free")] == 11
    assert series[(WAITING, "all")] == 13
    kv = [series[(KV_USAGE, tier)] for tier in ("premium", "standard", "free", "all")]
    assert kv == sorted(kv) and len(set(kv)) == 4
    assert series[(KV_USAGE, "free")] < series[(KV_USAGE, "all")]


def test_the_series_are_on_the_client_port_and_carry_no_tenant(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: Path
) -> None:
    harness, stub, threads = _held_queue(stub_sidecar, keys, tmp_path)
    try:
        client = http_get(harness.url + "/metrics", timeout=30).text
        admin = http_get(harness.admin_url + "/metrics", timeout=30).text
    finally:
        stub.release()
        for thread in threads:
            thread.join(60)
    samples = [s for f in text_string_to_metric_families(client) for s in f.samples
               if s.name in (WAITING, KV_USAGE)]
    assert {s.labels["tier"] for s in samples} == {"premium", "standard", "free", "all"}
    assert all(set(s.labels) == {"tier"} for s in samples)  # never a tenant's name
    assert WAITING not in admin  # the admin port keeps its kvquota_* families


def test_without_known_capacity_only_the_waiting_series_is_served(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """No stats and no capacityBlocks: a KV fraction would be a guess, so none is
    served; the queue is still counted."""
    harness, _ = stub_sidecar()
    harness.apply(make_policy(tenant("acme", tier="premium", priority=0)))
    series = _scrape(http_get(harness.url + "/metrics", timeout=30).text)
    assert series[(WAITING, "premium")] == series[(WAITING, "all")] == 0
    assert not any(name == KV_USAGE for name, _ in series)


# -- the KV series' two limits, on the sidecar's own admission state (pure) ------------

CAPACITY = 1000
PREMIUM_MAX = 450  # premium's per-engine ceiling: 45% of the engine
FREE_MAX = 400


def _signals(stats: EngineStats, reserved: dict[str, int]) -> dict[str, float | None]:
    """Each tier's KV series on an engine whose plugin reports `stats` and whose
    sidecar's ledger holds `reserved` blocks per tenant (requests in flight)."""
    ledger = Ledger()
    for tenant_id, blocks in reserved.items():
        ledger.reserve(tenant_id, blocks)
    queue = AdmissionQueue(ledger, clock=lambda: 0.0, stats=lambda: stats)
    policy = make_policy(
        tenant("acme", tier="premium", priority=0, guaranteed_blocks=400,
               max_blocks_per_engine=PREMIUM_MAX),
        tenant("initech", tier="free", priority=2, guaranteed_blocks=50,
               max_blocks_per_engine=FREE_MAX))
    queue.set_policy(policy)
    return {s.tier: s.kv_usage for s in tier_signals(policy, stats, queue, queue.view())}


def _engine(**tenants: TenantEngineStats) -> EngineStats:
    used = sum(t.running_blocks + t.leased_blocks for t in tenants.values())
    return EngineStats(timestamp=0, total_blocks=CAPACITY, free_blocks=CAPACITY - used,
                       tenants=tenants)


def test_an_engine_at_premiums_ceiling_reads_full_to_premium_with_most_of_the_cache_free(
) -> None:
    """Premium's request would queue on its own per-engine maxBlocks here, whatever the
    cache has free: its picker must see that, not 44% of the cache."""
    signals = _signals(_engine(acme=TenantEngineStats(running_blocks=400)), {"acme": 440})
    assert signals["all"] == 0.44
    assert signals["premium"] == round(440 / PREMIUM_MAX, 6) > 0.97


def test_free_work_and_premiums_own_idle_leases_leave_premium_reading_low() -> None:
    """An engine full of free work, and where premium's sessions cache their prefixes
    (idle leases its own next turns reuse), has room for premium: it reads low to
    premium's picker and full to free's."""
    stats = _engine(initech=TenantEngineStats(running_blocks=380),
                    acme=TenantEngineStats(leased_blocks=300, pinned_blocks=300))
    signals = _signals(stats, {"initech": 380})
    assert signals["all"] == 0.68
    assert signals["premium"] == 0.0
    # 20 blocks left under its 400 here (the cache, premium's leases ahead, has 320).
    assert signals["free"] == round(1 - 20 / FREE_MAX, 6)


def test_a_tier_reads_the_engine_where_it_has_fewer_blocks_left_as_fuller() -> None:
    """Free's picker compares its room in blocks: an engine the tier ahead nearly fills
    (premium's sessions leave 150 blocks, 50 above the watermark that a borrower may
    not take) reads fuller to free than one where free's own work has taken half its
    ceiling (200 left), though the first is further from free's ceiling. Each reads full
    when nothing more of free fits, an idle engine empty."""
    premium_full = _signals(_engine(acme=TenantEngineStats(running_blocks=450,
                                                           leased_blocks=400,
                                                           pinned_blocks=400)),
                            {"acme": 450})
    free_half = _signals(_engine(initech=TenantEngineStats(running_blocks=200)),
                         {"initech": 200})
    assert premium_full["free"] == round(1 - 50 / FREE_MAX, 6)
    assert free_half["free"] == round(1 - 200 / FREE_MAX, 6)
    assert premium_full["free"] > free_half["free"]
    assert premium_full["premium"] == 1.0  # premium at its own ceiling there
    free_at_ceiling = _signals(_engine(initech=TenantEngineStats(running_blocks=400)),
                               {"initech": 400})
    assert free_at_ceiling["free"] == 1.0
    assert free_at_ceiling["premium"] == 0.0
    idle = _signals(_engine(), {})
    assert idle["free"] == idle["premium"] == idle["all"] == 0.0
