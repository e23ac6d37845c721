"""vLLM's OffloadingConnector on the real CPU engine (via kvquota_lab.cpu_offload), with
the plugin loaded.

A prompt's prefix is evicted from the engine's KV cache by a flood of other prompts, then
comes back from the host-memory offload tier: vLLM's external prefix-cache counters show
the hit, and the reloaded KV reproduces the output exactly. The tiny random model attends
almost uniformly, so it cannot see KV blocks loaded in the wrong order; an in-process test
pins the worker's block-to-chunk mapping instead.

Under a burst that forces preemptions, the plugin honours `recomputeBelowBlocks`: victims
at or above it reload from the offload tier, smaller ones recompute, and its stats say
which happened.

This engine loads the plugin by 0.1.0's class path, as a manifest 0.1.0 injected and a
team kept in Git still names it (the session engine uses today's): the plugin runs, and
the engine's log says once that the path is deprecated.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from plugin_policies import engine_policy, tenant, wait_stats, write_policy

from engine_sidecar.contract.renamed import BY_OLD

pytestmark = pytest.mark.engine

OLD_PLUGIN_CLASS = "engine_sidecar.scheduler.TenantAwareScheduler"  # 0.1.0's
PROMPT_TOKENS = 1_500
FLOOD_PROMPT_TOKENS = 1_900
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def offload_engine(serve_engine: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    """A second engine: a small KV cache (256 blocks) over a 32 MiB offload tier, with
    the plugin loaded by its deprecated path."""
    with serve_engine(
        plugin_class=OLD_PLUGIN_CLASS,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=4 * 1024 * 1024,
        kv_offload_bytes=32 * 1024 * 1024,
        log_stats=True,  # the Prometheus counters below
    ) as engine:
        yield engine


def _metrics(client: httpx.Client) -> tuple[dict[str, float], int]:
    """vLLM's prefix-cache counters, and the engine's KV cache size in blocks."""
    text = client.get("/metrics").text
    counters = {
        name: sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{.*}} (\S+)$", text, re.M))
        for name in ("prefix_cache_hits", "external_prefix_cache_hits",
                     "external_prefix_cache_queries", "kv_offload_load_bytes")
    }
    blocks = re.search(r'^vllm:cache_config_info{.*num_gpu_blocks="(\d+)"', text, re.M)
    assert blocks, "vllm:cache_config_info has no num_gpu_blocks"
    return counters, int(blocks.group(1))


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    response = client.post("/v1/completions", json={
        "model": client.get("/v1/models").json()["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 3,
        "return_token_ids": True,
    })
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["top_logprobs"]}


def test_evicted_prefix_comes_back_from_the_offload_tier(offload_engine: Any) -> None:
    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, 2000) for _ in range(n)]

    with httpx.Client(base_url=offload_engine.url, timeout=120) as client:
        first = prompt(PROMPT_TOKENS)
        cold = _complete(client, first, 8)
        # Same prompt again: a local (engine KV cache) prefix hit, the reference for
        # the exact logprobs of a run that computes only the prompt's tail.
        before, total_blocks = _metrics(client)
        local = _complete(client, first, 8)
        local_hits = _delta(_metrics(client)[0], before)

        # ~1.5x the KV cache in other prompts evicts `first` from it (LRU).
        flood = (3 * total_blocks * BLOCK_SIZE) // (2 * FLOOD_PROMPT_TOKENS) + 1
        for _ in range(flood):
            _complete(client, prompt(FLOOD_PROMPT_TOKENS), 1)

        before, _ = _metrics(client)
        reloaded = _complete(client, first, 8)
        hits = _delta(_metrics(client)[0], before)

    summary = f"local run {local_hits}, after a flood of {flood} prompts {hits}"
    assert local_hits["prefix_cache_hits"] >= 0.9 * PROMPT_TOKENS, summary
    assert hits["prefix_cache_hits"] == 0, "flood did not evict the prefix: " + summary
    assert hits["external_prefix_cache_hits"] >= 0.9 * PROMPT_TOKENS, summary
    assert hits["kv_offload_load_bytes"] > 0, summary
    # Greedy tokens alone are weak evidence (the tiny model barely reads its context);
    # logprobs equal to full float precision show the reloaded KV bytes are right.
    assert reloaded["tokens"] == cold["tokens"]
    assert reloaded["logprobs"] == local["logprobs"]


async def _burst(url: str, prompts: list[list[int]]) -> list[int]:
    """Free-tier requests all at once; the completion tokens each got."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: list[int]) -> int:
            response = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": BURST_OUTPUT_TOKENS,
                "ignore_eos": True, "temperature": 0, "priority": 2,
                "vllm_xargs": {"kvq_tenant": "freeco"},
            })
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        return await asyncio.gather(*(one(prompt) for prompt in prompts))


BURST_PROMPT_TOKENS = 1_200  # 38 blocks per victim
BURST_OUTPUT_TOKENS = 300


@pytest.mark.parametrize(("recompute_below_blocks", "mode"), [(8, "offload"), (4096, "recompute")])
def test_preempted_victims_reload_or_recompute_by_policy(
    offload_engine: Any, recompute_below_blocks: int, mode: str
) -> None:
    policy = engine_policy(tenant("freeco", "free"), block_size=BLOCK_SIZE,
                           recompute_below_blocks=recompute_below_blocks)
    write_policy(offload_engine.policy_path, policy)
    before = wait_stats(offload_engine.stats_path, lambda s: s.policy_version == policy.version)
    rng = random.Random(recompute_below_blocks)  # fresh prompts: nothing to reload but victims
    # ~2.5x the KV cache once every request has decoded: decode growth must preempt.
    per_request = (BURST_PROMPT_TOKENS + BURST_OUTPUT_TOKENS) // BLOCK_SIZE
    count = (5 * before.total_blocks) // (2 * per_request) + 1
    prompts = [[rng.randrange(16, 2000) for _ in range(BURST_PROMPT_TOKENS)]
               for _ in range(count)]
    with httpx.Client(base_url=offload_engine.url, timeout=60) as client:  # not a speed test
        loaded_before = _metrics(client)[0]["kv_offload_load_bytes"]
        outputs = asyncio.run(_burst(offload_engine.url, prompts))
        loaded = _metrics(client)[0]["kv_offload_load_bytes"] - loaded_before
    after = wait_stats(offload_engine.stats_path,
                        lambda s: sum(t.running + t.waiting for t in s.tenants.values()) == 0)

    modes = {m: after.preemptions_by_mode.get(m, 0) - before.preemptions_by_mode.get(m, 0)
             for m in ("offload", "recompute")}
    summary = f"{count} requests into {before.total_blocks} blocks: {modes}, {loaded:.0f} B loaded"
    assert outputs == [BURST_OUTPUT_TOKENS] * count, summary
    assert after.preemption_mode == "offload"
    assert after.tenants["freeco"].preemptions.get("borrower", 0) > \
        before.tenants["freeco"].preemptions.get("borrower", 0), "no preemption: " + summary
    assert after.tenants["freeco"].swapped_blocks == 0
    if mode == "offload":
        assert modes["offload"] >= 1 and loaded > 0, summary
    else:
        assert modes == {"offload": 0, "recompute": modes["recompute"]}, summary
        assert modes["recompute"] >= 1 and loaded == 0, summary


def test_the_deprecated_class_path_runs_the_plugin_and_says_so_once(
    offload_engine: Any,
) -> None:
    """The plugin itself is at work in the tests above (its stats, its victims)."""
    log = offload_engine.process.log_path.read_text()
    assert log.count(BY_OLD[OLD_PLUGIN_CLASS].message()) == 1, log[-3000:]


def test_worker_maps_engine_blocks_to_host_chunks() -> None:
    """Chunks of 3 blocks; group 0 starts mid-chunk (logical block 2) and has a ref that
    copies only 48 of its 64-byte pages; group 1 uses only the first tensor."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvquota_lab.cpu_offload import SyncCPUOffloadingWorker

    a = torch.randint(-100, 100, (20, 64), dtype=torch.int8)
    b = torch.randint(-100, 100, (20, 64), dtype=torch.int8)
    worker = SyncCPUOffloadingWorker(CanonicalKVCaches(
        [CanonicalKVCacheTensor(a, 64), CanonicalKVCacheTensor(b, 64)],
        [[CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(1, 48)], [CanonicalKVCacheRef(0, 64)]],
    ), blocks_per_chunk=3, num_chunks=8)
    chunks = CPULoadStoreSpec([5, 1, 3])  # group 0: chunk 5 slot 2, chunk 1 slots 0-2
    assert worker.submit_store(1, GPULoadStoreSpec([7, 3, 11, 0, 4, 9], [4, 2], [2, 0]), chunks)
    host_a, host_b = (host.view(8, 3, 64) for host in worker._host)
    assert torch.equal(host_a[[5, 1, 1, 1, 3, 3], [2, 0, 1, 2, 0, 1]], a[[7, 3, 11, 0, 4, 9]])
    assert torch.equal(host_b[[5, 1, 1, 1], [2, 0, 1, 2], :48], b[[7, 3, 11, 0], :48])
    assert not host_b[:, :, 48:].any() and not host_b[3].any()

    stored_a, stored_b = a.clone(), b.clone()
    a.zero_()
    b.zero_()
    assert worker.submit_load(2, chunks, GPULoadStoreSpec(list(range(12, 18)), [4, 2], [2, 0]))
    assert torch.equal(a[12:18], stored_a[[7, 3, 11, 0, 4, 9]])
    assert torch.equal(b[12:16, :48], stored_b[[7, 3, 11, 0], :48])
    assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
        (1, True, 4 * (64 + 48) + 2 * 64), (2, True, 4 * (64 + 48) + 2 * 64)]
    assert worker.get_finished() == []
