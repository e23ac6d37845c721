"""vLLM's KV blocks as the plugin's parts see them: `engine_port.Engine`, complete.

Leases pin and unpin vLLM's blocks, the victim order counts each tenant's distinct
blocks, and retention reorders vLLM's free queue; every one of those touches vLLM's
private block pool, so all of it is here. docs/scheduler-plugin.md lists every
touchpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from engine_sidecar.plugin.core.engine_port import EngineFacts, RunningEntry
from engine_sidecar.plugin.vllm_requests import VllmRequests

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


class VllmEngine(VllmRequests):
    """`engine_port.Engine` over one vLLM scheduler."""

    def engine_facts(self, *, steer_victims: bool, offloading: bool,
                     vllm_version: str) -> EngineFacts:
        return EngineFacts(
            block_size=int(self._scheduler.block_size),
            # Block 0 is vLLM's null block, never allocatable.
            num_blocks=int(self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1,
            steer_victims=steer_victims, offloading=offloading, vllm_version=vllm_version,
        )

    # -- KV blocks -----------------------------------------------------------------------


    def request_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """All blocks a request holds, over every KV cache group."""
        groups = self._scheduler.kv_cache_manager.coordinator.get_blocks(req_id)
        if len(groups) == 1:
            return groups[0]
        return [block for group in groups for block in group]


    def num_blocks_held(self, req_id: str) -> int:
        return sum(1 for block in self.request_blocks(req_id) if not block.is_null)


    def cached_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """The request's blocks that are in the prefix cache, in prefix order."""
        return [
            block
            for block in self.request_blocks(req_id)
            if block.block_hash is not None and not block.is_null
        ]


    def scan_running(
        self,
        identities: Mapping[str, Any],
        known_tenants: Container[str],
        marked: Mapping[str, tuple[Any, int]],
    ) -> tuple[list[RunningEntry], dict[str | None, int], dict[str | None, set[int]]]:
        """One pass over `running` for victim ranking (it is hot under memory pressure).

        Returns per request its `engine_port.RunningEntry`; per tenant
        (None: unclassified) the blocks only one request holds; and per tenant the ids of
        shared (prefix) blocks, so that distinct blocks = unshared + len(shared ids).
        `identities` maps req_id to an object with a `tenant` attribute."""
        managers = self._scheduler.kv_cache_manager.coordinator.single_type_managers
        get_blocks = managers[0].req_to_blocks.get if len(managers) == 1 else None
        entries: list[RunningEntry] = []
        usage: dict[str | None, int] = {}
        shared: dict[str | None, set[int]] = {}
        # Bound methods in locals: this loop runs over every running request.
        append = entries.append
        get_identity = identities.get
        get_usage = usage.get
        for request in self._scheduler.running:
            req_id = request.request_id
            priority = request.priority
            if marked and req_id in marked:
                priority = marked[req_id][1]
            identity = get_identity(req_id)
            tenant = identity.tenant if identity is not None else None
            if tenant not in known_tenants:  # also None
                tenant = None
            if get_blocks is not None:
                blocks = get_blocks(req_id) or []
            else:
                blocks = self.request_blocks(req_id)
            held = len(blocks)
            if held:
                first = blocks[0]
                if first.ref_cnt > 1 or first.is_null:
                    held = self.count_unshared_blocks(blocks, shared.setdefault(tenant, set()))
            usage[tenant] = get_usage(tenant, 0) + held
            append((request, req_id, tenant, priority, request.num_computed_tokens,
                    request.arrival_time))
        return entries, usage, shared


    @staticmethod
    def count_unshared_blocks(blocks: list[KVCacheBlock], shared_ids: set[int]) -> int:
        """Blocks only this holder references; the shared leading blocks (refcount > 1,
        a common prefix) go into `shared_ids` instead, to be counted once."""
        num_shared = 0
        for block in blocks:
            if block.is_null:  # counted below; vLLM 0.33 no longer maintains its ref_cnt
                continue
            if block.ref_cnt <= 1:
                break
            shared_ids.add(block.block_id)
            num_shared += 1
        num_null = (sum(1 for block in blocks if block.is_null)
                    if blocks and blocks[0].is_null else 0)
        return len(blocks) - num_shared - num_null


    @staticmethod
    def count_lease_only_blocks(
        blocks: list[KVCacheBlock], running_shared: Container[int], counted: set[int]
    ) -> int:
        """Blocks of a lease no running request holds: refcount 1 (the lease alone), or
        shared only with other leases (counted once, via `counted`). Running requests
        share a lease's blocks only as their prefix, which `scan_running` reported."""
        num = 0
        for block in blocks:
            if block.ref_cnt == 1:
                num += 1
            elif block.block_id not in running_shared and block.block_id not in counted:
                counted.add(block.block_id)
                num += 1
        return num


    @staticmethod
    def block_id(block: KVCacheBlock) -> int:
        return block.block_id


    @staticmethod
    def _owning_pool(block: KVCacheBlock) -> Any | None:
        """The pool a block belongs to, when not the manager's own (deferred frees). vLLM
        0.34 holds it as a weak reference, 0.32-0.33 directly."""
        pool = block.pool
        if isinstance(pool, weakref.ref):
            return pool()
        return pool


    def pin_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Take one reference on each block (a block at refcount 0 leaves the free queue)."""
        main_pool = self._scheduler.kv_cache_manager.block_pool
        by_pool: dict[Any, list[KVCacheBlock]] = {}
        for block in blocks:
            by_pool.setdefault(self._owning_pool(block) or main_pool, []).append(block)
        for pool, pool_blocks in by_pool.items():
            pool.touch(pool_blocks)


    def unpin_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop the references `pin_blocks` took; blocks at refcount 0 go back to vLLM's
        LRU free queue, still hashed, the tail of the prefix first in line for eviction."""
        self._scheduler.kv_cache_manager.block_pool.free_blocks(reversed(blocks))


    def free_block_count(self) -> int:
        return int(self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks())




    def next_evicted_block_id(self, within: int = 64) -> int | None:
        """The cached block allocations will evict next, if one is among the first `within`
        free blocks: vLLM's free queue is LRU, with blocks that hold no cached prefix (the
        partial last block of every finished request) in front, taken first."""
        head = self._scheduler.kv_cache_manager.block_pool.free_block_queue.fake_free_list_head
        block = head.next_free_block
        for _ in range(within):
            if block is None or block.block_id < 0:  # the queue's fake tail: nothing cached
                return None
            if block.block_hash is not None and not block.is_null:
                return int(block.block_id)
            block = block.next_free_block
        return None


    def evict_first(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Move free cached blocks to the front of vLLM's LRU queue: the next allocations
        evict them before any other cached block. `blocks` in eviction order."""
        pool = self._scheduler.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        moved = [
            block for block in blocks
            if block.ref_cnt == 0 and not block.is_null and block.prev_free_block is not None
            and self._owning_pool(block) in (None, pool)
        ]
        for block in moved:
            queue.remove(block)
        queue.prepend_n(moved)
