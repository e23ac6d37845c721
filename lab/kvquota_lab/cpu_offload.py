"""vLLM's KV offloading connector on the CPU engine, for tests and demos.

vLLM's `OffloadingConnector` stores KV blocks to a host-memory tier and loads them back
(e.g. after a preemption or a prefix-cache eviction). Its stock `CPUOffloadingSpec` only
runs on CUDA-alike and XPU GPUs: the worker side drives device streams and events, and
`get_worker` refuses every other platform. This spec keeps that spec's scheduler side
unchanged (the `CPUOffloadingManager`, chunk count and LRU eviction) and swaps in a
worker that copies synchronously between the CPU engine's KV-cache tensors and a plain
host buffer, so a real vLLM CPU engine can exercise the offload tier end to end.

It is not a production path: copies block the engine step, and vLLM's canonical
(parallelism-free) host layout is not supported. Enable it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CPUEngineOffloadingSpec",
      "spec_module_path": "kvquota_lab.cpu_offload", "cpu_bytes_to_use": 67108864}}'
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class SyncCPUOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between engine KV tensors and host chunks, synchronously.

    Mirrors vLLM's `CPUOffloadingWorker` direct layout: for each canonical KV tensor of
    shape (num_blocks, page) the host holds (num_chunks, page * blocks_per_chunk), i.e.
    chunk c is the host rows c * blocks_per_chunk .. + blocks_per_chunk - 1. Per KV cache
    group, the first `block_indices[g] % blocks_per_chunk` rows of the group's first
    chunk are skipped (an engine block range need not start on a chunk boundary), and
    each layer ref copies its un-padded `page_size_bytes` of every page.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self._blocks_per_chunk = blocks_per_chunk
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            page = kv.page_size_bytes
            self._engine.append(kv.tensor.view(torch.int8).view(-1, page))
            self._host.append(torch.zeros(num_chunks * blocks_per_chunk, page, dtype=torch.int8))
        # Per group, the distinct (tensor index, bytes per page) copies; layers that alias
        # one tensor share it.
        self._copies = [
            sorted({(ref.tensor_idx, ref.page_size_bytes) for ref in refs})
            for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, engine: GPULoadStoreSpec, host: LoadStoreSpec,
              store: bool) -> bool:
        assert isinstance(host, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        chunk_ids = host.block_ids.astype(np.int64)
        engine_ids = engine.block_ids.astype(np.int64)
        engine_offset = chunk_offset = num_bytes = 0
        groups = zip(self._copies, engine.group_sizes, engine.block_indices, strict=True)
        for copies, size, first_block in groups:
            if size == 0:
                continue
            skip = first_block % self._blocks_per_chunk
            num_chunks = cdiv(size + skip, self._blocks_per_chunk)
            chunks = chunk_ids[chunk_offset:chunk_offset + num_chunks]
            host_rows = torch.from_numpy(
                (chunks[:, None] * self._blocks_per_chunk
                 + np.arange(self._blocks_per_chunk)).ravel()[skip:skip + size]
            )
            engine_rows = torch.from_numpy(engine_ids[engine_offset:engine_offset + size])
            for tensor_idx, page_bytes in copies:
                engine_kv, host_kv = self._engine[tensor_idx], self._host[tensor_idx]
                if store:
                    host_kv[host_rows, :page_bytes] = engine_kv[engine_rows, :page_bytes]
                else:
                    engine_kv[engine_rows, :page_bytes] = host_kv[host_rows, :page_bytes]
                num_bytes += size * page_bytes
            engine_offset += size
            chunk_offset += num_chunks
        assert engine_offset == len(engine_ids) and chunk_offset == len(chunk_ids)
        self._finished.append(
            TransferResult(job_id, True, num_bytes, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every job completed inside its submit call

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()


class CPUEngineOffloadingSpec(CPUOffloadingSpec):
    """`CPUOffloadingSpec` whose worker side also runs on vLLM's CPU platform."""

    _sync_worker: SyncCPUOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("CPUEngineOffloadingSpec does not support canonical_layout")
        if self._sync_worker is None:
            self._sync_worker = SyncCPUOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._sync_worker
