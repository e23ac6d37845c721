"""Admission decisions (DESIGN.md section 4), pure: no I/O, no clock, no globals.

Order of checks, cheapest refusal first and the most specific reason wins:
prompt length (400) -> request larger than the tenant's whole quota (400) ->
concurrency (429) -> block quota (429) -> watermark for borrowers (503).
A request that stays within the tenant's guaranteed blocks is never refused for the
watermark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.policy import TenantPolicy
from engine_sidecar.stats import EngineStats


class Decision(StrEnum):
    ADMITTED = "admitted"
    REJECTED_QUOTA = "rejected_quota"
    REJECTED_CONCURRENCY = "rejected_concurrency"
    REJECTED_WATERMARK = "rejected_watermark"
    REJECTED_PROMPT = "rejected_prompt"
    REJECTED_AUTH = "rejected_auth"


@dataclass(frozen=True)
class RequestShape:
    """What admission needs from a request body."""

    prompt_tokens: tuple[int, ...]  # one entry per prompt (completions may batch)
    requested_max_tokens: int | None
    n: int = 1
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True)
class TenantLoad:
    reserved_blocks: int  # outstanding reservations (the ledger)
    leased_blocks: int  # pinned by the plugin's leases (count as usage)
    inflight: int

    @property
    def used_blocks(self) -> int:
        return self.reserved_blocks + self.leased_blocks


@dataclass(frozen=True)
class Capacity:
    """Engine KV capacity as admission sees it; unknown -> no watermark check."""

    total_blocks: int | None
    free_blocks: int | None
    source: str | None  # "engine", "policy" or None (unknown)

    @property
    def known(self) -> bool:
        return self.total_blocks is not None and self.free_blocks is not None


UNKNOWN_CAPACITY = Capacity(None, None, None)


def capacity_view(
    capacity_override: int | None, stats: EngineStats | None, reserved_total: int
) -> Capacity:
    """Free blocks = capacity - what the engine uses - reservations not yet allocated.

    Reservations of running requests are partly allocated already (they show in the
    engine's used blocks); only the excess over the plugin's running blocks counts
    again. Without stats every reservation counts.
    """
    engine_total = stats.total_blocks if stats and stats.total_blocks > 0 else None
    total = capacity_override or engine_total
    if total is None:
        return UNKNOWN_CAPACITY
    if stats is not None and engine_total is not None:
        used = max(0, stats.total_blocks - stats.free_blocks)
        running = sum(t.running_blocks for t in stats.tenants.values())
    else:
        used, running = 0, 0
    outstanding = max(0, reserved_total - running)
    free = max(0, total - used - outstanding)
    source = "policy" if capacity_override else "engine"
    return Capacity(total, free, source)


def effective_max_tokens(
    tenant: TenantPolicy, shape: RequestShape, max_model_len: int | None
) -> int:
    """Clamp to the tenant's ceiling; default when absent (fitting the model length)."""
    if shape.requested_max_tokens is not None:
        return min(shape.requested_max_tokens, tenant.max_tokens)
    default = tenant.default_max_tokens
    if max_model_len and shape.prompt_tokens:
        room = max_model_len - max(shape.prompt_tokens)
        if room >= 1:
            default = min(default, room)
    return default


def blocks_for(shape: RequestShape, max_tokens: int, block_size: int) -> int:
    """ceil((prompt + max_tokens) / blockSize) per sequence, every prompt times n."""
    return sum(
        shape.n * math.ceil((prompt + max(max_tokens, 0)) / block_size)
        for prompt in shape.prompt_tokens
    )


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    max_tokens: int
    blocks: int
    error: ApiError | None = None

    @property
    def admitted(self) -> bool:
        return self.decision is Decision.ADMITTED


def decide(
    tenant: TenantPolicy,
    shape: RequestShape,
    *,
    block_size: int,
    watermark: float,
    load: TenantLoad,
    capacity: Capacity,
    max_model_len: int | None,
    retry_after: int,
) -> Verdict:
    max_tokens = effective_max_tokens(tenant, shape, max_model_len)
    blocks = blocks_for(shape, max_tokens, block_size)
    longest = max(shape.prompt_tokens, default=0)

    def refuse(decision: Decision, error: ApiError) -> Verdict:
        return Verdict(decision, max_tokens, blocks, error)

    if tenant.max_prompt_tokens is not None and longest > tenant.max_prompt_tokens:
        return refuse(Decision.REJECTED_PROMPT, ApiError(
            400, errors.PROMPT_TOO_LONG,
            f"the prompt has {longest} tokens; tenant {tenant.tenant_id!r} may send at most "
            f"{tenant.max_prompt_tokens}. Shorten the prompt.",
            param=shape.prompt_param,
        ))
    if max_model_len is not None and longest >= max_model_len:
        return refuse(Decision.REJECTED_PROMPT, ApiError(
            400, errors.PROMPT_TOO_LONG,
            f"the prompt has {longest} tokens; the model's context is {max_model_len} "
            "tokens, including the completion. Shorten the prompt.",
            param=shape.prompt_param,
        ))
    if blocks > tenant.max_blocks:
        # Retrying can never help, so this is not a 429.
        return refuse(Decision.REJECTED_QUOTA, ApiError(
            400, errors.REQUEST_EXCEEDS_TENANT_QUOTA,
            f"this request needs {blocks} KV blocks (prompt + max_tokens={max_tokens}), "
            f"more than tenant {tenant.tenant_id!r} may hold on one engine "
            f"({tenant.max_blocks}). Lower max_tokens or shorten the prompt.",
            param=shape.max_tokens_param,
        ))
    limit = tenant.max_concurrent_requests
    if limit is not None and load.inflight >= limit:
        return refuse(Decision.REJECTED_CONCURRENCY, ApiError(
            429, errors.TENANT_CONCURRENCY_EXHAUSTED,
            f"tenant {tenant.tenant_id!r} already has {load.inflight} requests in flight "
            f"(limit {limit} per engine). Retry after one finishes.",
            retry_after=retry_after,
        ))
    if load.used_blocks + blocks > tenant.max_blocks:
        return refuse(Decision.REJECTED_QUOTA, ApiError(
            429, errors.TENANT_BLOCK_QUOTA_EXHAUSTED,
            f"tenant {tenant.tenant_id!r} holds {load.used_blocks} of its {tenant.max_blocks} "
            f"KV blocks; this request needs {blocks} more. Retry later or lower max_tokens.",
            retry_after=retry_after,
        ))
    borrowing = load.used_blocks + blocks > tenant.guaranteed_blocks
    if borrowing and capacity.known:
        assert capacity.total_blocks is not None and capacity.free_blocks is not None
        floor = math.ceil(watermark * capacity.total_blocks)
        if capacity.free_blocks - blocks < floor:
            return refuse(Decision.REJECTED_WATERMARK, ApiError(
                503, errors.KV_CACHE_WATERMARK_EXCEEDED,
                f"the engine's KV cache is nearly full ({capacity.free_blocks} of "
                f"{capacity.total_blocks} blocks free, {floor} kept for guaranteed "
                f"capacity) and this request would borrow beyond tenant "
                f"{tenant.tenant_id!r}'s {tenant.guaranteed_blocks} guaranteed blocks. "
                "Retry later.",
                retry_after=retry_after,
            ))
    return Verdict(Decision.ADMITTED, max_tokens, blocks)
