"""The plugin's one hook into vLLM's KV allocation.

vLLM's scheduler allocates through `KVCacheManager.allocate_slots`, which returns None
when the blocks are not free. The plugin must hear of every such failure to apply its
victim order, release leases and enter degraded mode. The scheduler builds its KV cache
manager itself, with arguments that change between vLLM releases, so the plugin gives
that one instance this subclass's type once, right after vLLM built it; nothing is
reassigned afterwards, and wrappers others put on the instance stay in the chain.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

AllocationFailureHandler = Callable[
    ["Request", Callable[[], "KVCacheBlocks | None"], Callable[[], int]],
    "KVCacheBlocks | None",
]

# allocate_slots' parameters after (request, num_new_tokens), to name positional ones.
_MORE_PARAMETERS = tuple(inspect.signature(KVCacheManager.allocate_slots).parameters)[3:]


class HookedKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager that calls `on_failure(request, retry, shortfall)` when
    `allocate_slots` finds no room.

    The handler may free blocks and `retry()` (allocation has no side effects until it
    succeeds), or ask `shortfall()` how many free blocks were missing; whatever it
    returns is what vLLM's scheduler sees."""

    on_failure: AllocationFailureHandler

    @classmethod
    def adopt(cls, manager: KVCacheManager, on_failure: AllocationFailureHandler
              ) -> HookedKVCacheManager:
        """Make the manager vLLM just built report its failures to `on_failure`."""
        manager.__class__ = cls
        assert isinstance(manager, cls)
        manager.on_failure = on_failure
        return manager

    def allocate_slots(
        self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> KVCacheBlocks | None:
        allocate = super().allocate_slots
        blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if blocks is not None:
            return blocks
        named = dict(zip(_MORE_PARAMETERS, args, strict=False), **kwargs)
        return self.on_failure(
            request,
            lambda: allocate(request, num_new_tokens, *args, **kwargs),
            lambda: allocation_shortfall(self, request, num_new_tokens, named),
        )


def allocation_shortfall(
    manager: Any, request: Request, num_new_tokens: int, kwargs: Mapping[str, Any],
) -> int:
    """How many more free blocks the `allocate_slots` call that just failed needed.

    Mirrors `KVCacheManager.allocate_slots` (the same in vLLM 0.32 to 0.34): the
    blocks its coordinator would allocate, plus vLLM's own admission watermark and the
    caller's reserve, minus the free blocks. A layout this does not understand falls
    back to the blocks the new tokens fill."""
    pool = manager.block_pool
    num_lookahead_tokens = kwargs.get("num_lookahead_tokens", 0)
    try:
        computed = kwargs.get("new_computed_blocks")
        blocks = computed.blocks if computed is not None else manager.empty_kv_cache_blocks.blocks
        num_local = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
        num_external = kwargs.get("num_external_computed_tokens", 0)
        total = min(num_local + num_external, manager.max_model_len)
        num_main = total + num_new_tokens
        needed = manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=min(num_main + num_lookahead_tokens, manager.max_model_len),
            new_computed_blocks=blocks,
            num_encoder_tokens=kwargs.get("num_encoder_tokens", 0),
            total_computed_tokens=num_local + num_external,
            num_local_computed_tokens=num_local,
            num_tokens_main_model=num_main,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
        )
        if kwargs.get("has_scheduled_reqs", True) and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED
        ):
            needed += manager.watermark_blocks
        needed += kwargs.get("reserved_blocks", 0)
    except (AttributeError, TypeError):
        block_size = manager.coordinator.single_type_managers[0].block_size
        needed = -(-(num_new_tokens + num_lookahead_tokens) // block_size)
    return max(0, int(needed) - int(pool.get_num_free_blocks()))
