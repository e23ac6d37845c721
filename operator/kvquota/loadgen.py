"""A noisy-neighbour workload against an OpenAI-compatible endpoint, measured per tier.

Premium tenants hold multi-turn conversations with think time between turns; while
they think, a free-tier burst of long parallel prompts tries to fill the KV cache.
Each request streams, so time-to-first-token is measured where the user feels it; the
prefix-cache hit of a follow-up turn comes from vLLM's `usage.prompt_tokens_details`
(`--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

WORDS = (
    "tenant quota cache block lease premium standard free engine scheduler request token "
    "prompt answer session preempt evict admit reserve release watermark pool"
).split()


@dataclass(frozen=True)
class Result:
    tier: str
    tenant: str
    turn: int  # 0 for requests outside a conversation
    status: int
    code: str | None
    ttft: float | None
    total: float
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Target:
    """Where to send requests and how a tenant authenticates there."""

    url: str
    model: str
    headers: Callable[[str], dict[str, str]] = lambda tenant: {}


@dataclass(frozen=True)
class NoisyNeighbour:
    premium_tenant: str = "acme"
    free_tenant: str = "hobbyist"
    premium_sessions: int = 3
    turns: int = 3
    premium_prompt_words: int = 700
    turn_words: int = 40
    premium_max_tokens: int = 32
    think_seconds: float = 4.0
    burst_requests: int = 24
    burst_prompt_words: int = 900
    burst_max_tokens: int = 96
    seed: int = 7


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def complete(
    client: httpx.AsyncClient, target: Target, tier: str, tenant: str, prompt: str,
    max_tokens: int, turn: int = 0, session: str | None = None,
) -> tuple[Result, str]:
    """One streamed completion; returns its measurements and the generated text."""
    headers = dict(target.headers(tenant))
    if session:
        headers["X-Session-Id"] = session
    body = {
        "model": target.model, "prompt": prompt, "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with client.stream(
        "POST", f"{target.url}/v1/completions", json=body, headers=headers
    ) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                code = json.loads(raw)["error"].get("code")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = None
            total = time.perf_counter() - start
            return Result(tier, tenant, turn, resp.status_code, code and str(code), None, total), ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["text"])
    details = usage.get("prompt_tokens_details") or {}
    return Result(
        tier, tenant, turn, 200, None, ttft, time.perf_counter() - start,
        int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
    ), "".join(text)


async def _conversation(
    client: httpx.AsyncClient, target: Target, w: NoisyNeighbour, index: int,
    rng: random.Random, out: list[Result],
) -> None:
    session = f"{w.premium_tenant}-chat-{index}"
    context = _text(rng, w.premium_prompt_words)
    for turn in range(1, w.turns + 1):
        result, answer = await complete(
            client, target, "premium", w.premium_tenant, context, w.premium_max_tokens,
            turn, session,
        )
        out.append(result)
        context = f"{context}{answer} {_text(rng, w.turn_words)}"
        if turn < w.turns:
            await asyncio.sleep(w.think_seconds)


async def _burst(
    client: httpx.AsyncClient, target: Target, w: NoisyNeighbour, rng: random.Random,
    out: list[Result], done: asyncio.Event,
) -> None:
    """Waves of long free-tier prompts, back to back, until the conversations end."""
    await asyncio.sleep(w.think_seconds * 0.25)  # let the first turns land
    while not done.is_set():
        prompts = [_text(rng, w.burst_prompt_words) for _ in range(w.burst_requests)]
        results = await asyncio.gather(*(
            complete(client, target, "free", w.free_tenant, p, w.burst_max_tokens)
            for p in prompts
        ))
        out.extend(r for r, _ in results)
        if all(r.status != 200 for r, _ in results):
            await asyncio.sleep(0.5)  # refused outright: back off like a real client


async def run_noisy_neighbour(target: Target, w: NoisyNeighbour) -> list[Result]:
    rng = random.Random(w.seed)
    out: list[Result] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:
        # Warm-up: the first request compiles/loads; it is not measured.
        await complete(client, target, "warmup", w.premium_tenant, "warm up", 2)
        done = asyncio.Event()

        async def conversations() -> None:
            await asyncio.gather(*(
                _conversation(client, target, w, i, random.Random(w.seed + i), out)
                for i in range(w.premium_sessions)
            ))
            done.set()

        await asyncio.gather(conversations(), _burst(client, target, w, rng, out, done))
    return out


@dataclass
class TierSummary:
    tier: str
    ttfts: list[float] = field(default_factory=list)
    admitted: int = 0
    rejected_quota: int = 0
    rejected_watermark: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def percentile(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        if len(self.ttfts) == 1:
            return self.ttfts[0]
        return statistics.quantiles(self.ttfts, n=100, method="inclusive")[int(q) - 1]

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def summarise(results: list[Result]) -> dict[str, TierSummary]:
    tiers: dict[str, TierSummary] = {}
    for r in results:
        s = tiers.setdefault(r.tier, TierSummary(r.tier))
        if r.status == 200:
            s.admitted += 1
            if r.ttft is not None:
                s.ttfts.append(r.ttft)
            if r.turn > 1:  # follow-up turns: how much of the conversation was still cached
                s.prompt_tokens += r.prompt_tokens
                s.cached_tokens += r.cached_tokens
        elif r.status == 429:
            s.rejected_quota += 1
        elif r.status == 503 and r.code == "KV_CACHE_WATERMARK_EXCEEDED":
            s.rejected_watermark += 1
        else:
            s.failed += 1
    return tiers
