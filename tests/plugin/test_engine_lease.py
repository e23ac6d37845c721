"""The plugin inside the real vLLM OpenAI server (CPU, tiny model).

A premium two-turn session survives a free-tier burst that overflows the KV cache: its
second turn is a prefix-cache hit, read from the plugin's published stats. A control
session of a tenant without a lease, idle through the same burst, loses its prefix.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import pytest
from plugin_policies import engine_policy, tenant, wait_stats, write_policy

from engine_sidecar.contract.files import write_atomically

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 1_500
BURST_PROMPT_TOKENS = 1_900
BURST_OUTPUT_TOKENS = 64


async def _complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    *,
    tenant_id: str,
    priority: int,
    session: str | None = None,
) -> list[int]:
    xargs = {"kvq_tenant": tenant_id} | ({"kvq_session": session} if session else {})
    response = await client.post("/v1/completions", json={
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "priority": priority,
        "vllm_xargs": xargs,
        "return_token_ids": True,
    })
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


async def test_two_turn_session_keeps_its_prefix_under_pressure(engine):
    # Tenants of this test's own: the engine is shared, and the plugin learns from what
    # a tenant did before (its sessions' pauses decide when the cache of tenants without
    # leases is evicted first, `RetentionOrder`); here none has a history.
    run = uuid.uuid4().hex[:8]
    acme, plain, freeco = f"acme-{run}", f"plain-{run}", f"freeco-{run}"
    policy = engine_policy(
        tenant(acme, "premium", guaranteed=400, lease_seconds=300),
        tenant(plain, "premium", guaranteed=400),  # same tier, no lease: the control
        tenant(freeco, "free", guaranteed=0),
        block_size=engine.block_size,
    )
    previous = engine.policy_path.read_text() if engine.policy_path.exists() else None
    write_policy(engine.policy_path, policy)
    rng = random.Random(uuid.uuid4().int)  # fresh prompts: the engine is shared
    # A session of its own: the plugin times a lease by the session's earlier pauses,
    # and this one has none, so it holds for the whole lease however long the burst
    # takes on this machine.
    session = f"chat-{uuid.uuid4().hex[:8]}"

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, 2000) for _ in range(n)]

    try:
        before = wait_stats(engine.stats_path, lambda s: s.policy_version == policy.version)
        total_blocks = before.total_blocks
        acme_hits = before.tenants[acme].prefix_hit_tokens
        plain_hits = before.tenants[plain].prefix_hit_tokens
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            model = str(engine.model)
            turn1 = prompt(PROMPT_TOKENS)
            control1 = prompt(PROMPT_TOKENS)
            answer, control_answer = await asyncio.gather(
                _complete(client, model, turn1, 16, tenant_id=acme, priority=0,
                          session=session),
                _complete(client, model, control1, 16, tenant_id=plain, priority=0,
                          session=session),
            )
            leased = wait_stats(engine.stats_path,
                                 lambda s: s.tenants[acme].leased_sessions == 1)
            assert leased.tenants[acme].leased_blocks >= PROMPT_TOKENS // engine.block_size

            # Free-tier burst: ~1.5x the whole KV cache, all of it wanted at once. Each
            # request lives long enough (BURST_OUTPUT_TOKENS decode steps) that the
            # engine runs as many as the cache holds: it must evict cached blocks, not
            # just recycle the burst's own (the plugin's retention order hands a
            # finished free request's blocks out first).
            per_request = (BURST_PROMPT_TOKENS + BURST_OUTPUT_TOKENS) // engine.block_size + 1
            burst_size = max(8, (3 * total_blocks) // (2 * per_request))
            await asyncio.gather(*(
                _complete(client, model, prompt(BURST_PROMPT_TOKENS), BURST_OUTPUT_TOKENS,
                          tenant_id=freeco, priority=2)
                for _ in range(burst_size)
            ))

            context, control_context = [*turn1, *answer], [*control1, *control_answer]
            await _complete(client, model, [*context, *prompt(40)], 8, tenant_id=acme,
                            priority=0, session=session)
            await _complete(client, model, [*control_context, *prompt(40)], 8,
                            tenant_id=plain, priority=0, session=session)

        after = wait_stats(
            engine.stats_path,
            lambda s: s.tenants[plain].prompt_tokens
            >= before.tenants[plain].prompt_tokens + 2 * PROMPT_TOKENS,
        )
        acme_hit = after.tenants[acme].prefix_hit_tokens - acme_hits
        plain_hit = after.tenants[plain].prefix_hit_tokens - plain_hits
        summary = (f"leased session hit {acme_hit}/{len(context)}, control hit "
                   f"{plain_hit}/{len(control_context)}, burst {burst_size} x "
                   f"{BURST_PROMPT_TOKENS} tokens into {total_blocks} blocks")
        assert acme_hit >= 0.9 * len(context), summary
        assert plain_hit < 0.5 * len(control_context), "no eviction: " + summary
        assert after.tenants[acme].lease_breaks == 0
    finally:
        # Hand the shared engine back without this test's leases.
        if previous is not None:
            write_atomically(engine.policy_path, previous)
        else:
            write_policy(engine.policy_path, engine_policy(block_size=engine.block_size))
