"""Requests of the noisy-neighbour workload, and what each one measured.

Prompts are token ids of the tiny model (`kvquota_lab.tinymodel`), and each turn resends
the conversation with the tokens the engine generated (`return_token_ids`): the gateway
and vLLM count ids instead of tokenizing 86,400 tokens of text a wave, CPU that on 2
cores every request would wait for, and a follow-up's prefix is exactly what the engine
cached (re-tokenized text need not match the generated ids). Each request streams, so
time-to-first-token is measured where the user feels it: at the first chunk carrying a
token, even one that decodes to no text (a random-weight model often emits such
tokens; `kvquota_lab.stream_client` reads the stream). The prefix-cache hit of a turn
comes from vLLM's `usage.prompt_tokens_details` (`--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvquota_lab.stream_client import Target, completion_body, stream_completion
from kvquota_lab.tinymodel import SPECIAL_TOKENS, VOCAB_SIZE

FIRST_ID = len(SPECIAL_TOKENS)  # prompt ids: the tiny model's vocabulary after its specials
RETRYABLE = frozenset({429, 503})
MAX_BACKOFF = 2.0  # seconds, before jitter


@dataclass(frozen=True)
class Result:
    tier: str
    tenant: str
    turn: int  # 0 for requests outside a conversation
    round: int  # 0: first turns on the idle engine; r: the r-th burst wave
    status: int  # 0: no HTTP answer (transport error or client timeout, see `code`)
    code: str | None
    ttft: float | None
    total: float
    sent_at: float  # seconds since the workload started
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_ms: float | None = None  # the sidecar's x-kvquota-queue-ms, when it sends one
    headers_after: float | None = None  # seconds until the response headers (accepted)
    retry_after: float | None = None
    # premium follow-ups: how the burst held the cache when the turn was sent (None: it
    # did not within hold_timeout, the turn went anyway)
    held: str | None = None
    engine_waiting: int | None = None  # vLLM's waiting queue when the turn was sent
    # premium follow-ups: how late, at worst, the measuring client's own event loop woke
    # up while the round's turns were in flight (what the machine added to any timing)
    client_lag: float | None = None


@dataclass(frozen=True)
class NoisyNeighbour:
    premium_tenant: str = "acme"
    free_tenant: str = "hobbyist"
    # 10 conversations x 3 follow-ups = 30 follow-up turns per run. Their leases must fit
    # the samples' lease cap (192 blocks): the longest context is 300 + 3 x (32 + 40)
    # tokens + 32 generated = 17 blocks of 32, x 10 = 170.
    premium_sessions: int = 10
    turns: int = 4
    premium_prompt_tokens: int = 300
    turn_tokens: int = 40
    premium_max_tokens: int = 32
    # 96 x (900 + 64) tokens = 96 x 31 blocks, 4.6 caches of 640 blocks. On stock vLLM a
    # cache's worth runs while the rest waits for KV, so "the burst holds the cache" is
    # a state lasting several request lifetimes, not a moment (with 24, 1.2 caches, it
    # lasted ~0.3 s and a turn met it or not by luck), and a turn sent then queues
    # behind dozens of free requests, not two or three.
    burst_requests: int = 96
    burst_prompt_tokens: int = 900
    burst_max_tokens: int = 64  # the free tier's maxTokens: both runs do the same work
    # A machine busy with other work can feed a wave in slower than the engine drains
    # it (seen with a test suite installing beside the demo): the next wave gets
    # its chance within the same bound.
    hold_timeout: float = 60.0
    burst_timeout: float = 120.0
    request_timeout: float = 120.0
    seed: int = 7

    @property
    def follow_ups(self) -> int:
        return self.premium_sessions * (self.turns - 1)


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(count)]


async def complete(
    client: httpx.AsyncClient, target: Target, tier: str, tenant: str, prompt: list[int],
    max_tokens: int, *, turn: int = 0, round_no: int = 0, session: str | None = None,
    clock_start: float = 0.0, on_answer: Callable[[], None] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> tuple[Result, list[int]]:
    """One streamed completion; returns its measurements and the generated token ids.
    `on_answer` runs when the response's status arrives, `on_first_token` with the
    first token."""
    reply = await stream_completion(
        client, target.url, completion_body(target.model, prompt, max_tokens),
        target.request_headers(tenant, session), on_answer=on_answer,
        on_first_token=on_first_token)
    total = (reply.finish or reply.sent) - reply.sent
    sent_at = reply.sent - clock_start
    if reply.status != 200:
        return Result(tier, tenant, turn, round_no, reply.status, reply.code, None, total,
                      sent_at, retry_after=reply.retry_after), []
    ttft = None if reply.first_token is None else reply.first_token - reply.sent
    headers_after = None if reply.head is None else reply.head - reply.sent
    return Result(
        tier, tenant, turn, round_no, 200, None, ttft, total, sent_at,
        prompt_tokens=reply.prompt_tokens or 0, cached_tokens=reply.cached_tokens or 0,
        queue_ms=reply.queue_ms, headers_after=headers_after,
    ), reply.token_ids


def retry_delay(retry_after: float | None, refusals: int, rng: random.Random) -> float:
    """How long a refused client waits: Retry-After (1 s if absent) is the least, doubled
    for every refusal in a row up to MAX_BACKOFF, with "full jitter" up to three times
    that. Clients that come back as a herd are a second burst: the gateway authenticates
    and counts every one before it can refuse it, and premium turns arriving meanwhile
    wait behind them (0.4-0.9 s per turn on 2 busy cores with a 1-1.25x jitter and no
    doubling)."""
    least = min(max(retry_after if retry_after is not None else 1.0, 0.1), MAX_BACKOFF)
    return min(least * 2 ** (refusals - 1), MAX_BACKOFF) * rng.uniform(1.0, 3.0)
