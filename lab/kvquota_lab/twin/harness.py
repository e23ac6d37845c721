"""Step vLLM's real V1 scheduler without a model, on virtual time.

The harness builds `VllmConfig` + `KVCacheConfig` from a local model directory (only
its `config.json` is read: no network, no weights), instantiates vLLM's stock
`Scheduler` (FCFS or priority) or KVQuota's `TenantAwareScheduler` with a given number
of KV blocks, and steps it with fake `ModelRunnerOutput`s: every request whose
scheduled tokens reach its end samples one token; a request finishes at `max_tokens`.

Each `step()` returns a `StepRecord` with what was scheduled (prefill and decode
tokens, attention context), so a cost model can turn steps into virtual seconds
(`TwinConfig.step_cost`); by default a step takes `step_seconds`. Each request keeps
its admission step/time, first-token step/time, prefix-cache hit and preemptions.

With `kv_offload_bytes`, the scheduler runs vLLM's `OffloadingConnector` (its
scheduler side, unchanged) over a host tier of that size, and the harness plays the
worker: every store and load the step asks for completes within the step.

    harness = SchedulerHarness(TwinConfig(model_dir, num_blocks=640, scheduler="kvquota",
                                          policy_path=path))
    harness.add_request("a", prompt, max_tokens=32, tenant="acme", session="s1")
    harness.run_until_done()
    harness.requests["a"].num_cached_tokens
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_sidecar.contract.stats import EngineStats
    from engine_sidecar.plugin.rules.ranking import VictimRanker
    from engine_sidecar.plugin.scheduler import TenantAwareScheduler

SchedulerKind = Literal["stock-fcfs", "stock-priority", "kvquota"]
_FIRST_SAMPLED_TOKEN = 16  # below: special tokens (EOS is 2 in the tiny model)


@dataclass(frozen=True)
class TwinConfig:
    model_dir: Path
    num_blocks: int
    block_size: int = 16
    scheduler: SchedulerKind = "kvquota"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    # vLLM's OffloadingConnector with a host tier of this many bytes (0: none).
    kv_offload_bytes: int = 0
    # KVQuota only: policy and stats files (hot-loaded / published as in the engine).
    policy_path: Path | None = None
    stats_path: Path | None = None
    # The engine's pod name: which entry of the policy's per-engine split it enforces.
    engine_name: str | None = None
    # KVQuota only: the victim order's rules (None: the plugin's documented order).
    ranker: type[VictimRanker] | None = None
    # Virtual seconds per step: step_cost(record) if given, else step_seconds.
    step_seconds: float = 0.01
    step_cost: Callable[[StepRecord], float] | None = None


@dataclass
class TwinRequest:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int
    tenant: str | None
    session: str | None
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    admitted_step: int | None = None
    admitted_time: float | None = None
    first_token_step: int | None = None
    first_token_time: float | None = None
    finish_step: int | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    num_loaded_blocks: int = 0  # KV blocks reloaded from the offload tier

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class StepRecord:
    index: int
    start_time: float
    num_scheduled_tokens: dict[str, int]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_context_tokens: int  # attention context: computed + new tokens, per scheduled request
    admitted_req_ids: list[str]
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    num_free_blocks: int
    schedule_seconds: float  # wall time of schedule()
    update_seconds: float  # wall time of update_from_output()
    duration: float = 0.0  # virtual seconds
    # Per scheduled request: its KV length after the step (what `num_context_tokens`
    # sums), and which of them decoded (the rest computed prompt tokens).
    context_by_req: dict[str, int] = field(default_factory=dict)
    decode_req_ids: frozenset[str] = frozenset()
    first_token_req_ids: list[str] = field(default_factory=list)  # sampled their first


def build_vllm_config(config: TwinConfig) -> Any:
    """VllmConfig for the model directory: CPU device, no tokenizer, no weights."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(config.model_dir),
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,  # type: ignore[arg-type]  # None: the model's
        dtype="float32",
    )
    policy: Literal["fcfs", "priority"] = (
        "fcfs" if config.scheduler == "stock-fcfs" else "priority"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=False,
        policy=policy,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
    )
    cache_config = CacheConfig(
        block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    transfer_config = None
    if config.kv_offload_bytes:
        transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": config.kv_offload_bytes},
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer_config,
    )
    # The CPU platform turns async scheduling off while the config is built.
    vllm_config.scheduler_config.async_scheduling = config.async_scheduling
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return vllm_config


def build_kv_cache_config(vllm_config: Any, num_blocks: int) -> Any:
    """One full-attention group over the model's layers (the tiny model's layout)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model_config = vllm_config.model_config
    hf = model_config.hf_config
    num_layers = hf.num_hidden_layers
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
        head_size=model_config.get_head_size(),
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


class SchedulerHarness:
    """One scheduler, fake model outputs, virtual time (`now`)."""

    def __init__(self, config: TwinConfig) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = config
        self.now = 0.0
        self.steps: list[StepRecord] = []
        self.requests: dict[str, TwinRequest] = {}
        self._ids = itertools.count()
        vllm_config = build_vllm_config(config)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        kv_cache_config = build_kv_cache_config(vllm_config, config.num_blocks)
        scheduler_cls = self._scheduler_cls(config.scheduler)
        self.scheduler: Scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=config.block_size,
            log_stats=True,
            **self._plugin_arguments(config),
        )
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(config.block_size, hash_fn)

    def _plugin_arguments(self, config: TwinConfig) -> dict[str, Any]:
        """KVQuota's scheduler on the harness's files and virtual time."""
        if config.scheduler != "kvquota":
            return {}
        from engine_sidecar.plugin.config import PluginConfig
        from engine_sidecar.plugin.rules.ranking import VictimRanker

        return {"plugin_config": PluginConfig(
            policy_path=config.policy_path,
            stats_path=config.stats_path,
            clock=lambda: self.now,
            ranker=config.ranker or VictimRanker,
            engine=config.engine_name,
        )}

    @staticmethod
    def _scheduler_cls(kind: SchedulerKind) -> type[Scheduler]:
        if kind == "kvquota":
            from engine_sidecar.plugin.scheduler import TenantAwareScheduler

            return TenantAwareScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        return Scheduler

    @property
    def plugin(self) -> TenantAwareScheduler | None:
        """The scheduler as KVQuota's plugin, or None for a stock scheduler."""
        from engine_sidecar.plugin.scheduler import TenantAwareScheduler

        sched = self.scheduler
        return sched if isinstance(sched, TenantAwareScheduler) else None

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        req_id: str | None,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        priority: int = 0,
        tenant: str | None = None,
        session: str | None = None,
        arrival_time: float | None = None,
        extra_args: dict[str, Any] | None = None,
    ) -> TwinRequest:
        """Queue a request (its tenant/session travel as the sidecar sends them)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        args = dict(extra_args or {})
        if tenant is not None:
            args["kvq_tenant"] = tenant
        if session is not None:
            args["kvq_session"] = session
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=args or None)
        arrival = self.now if arrival_time is None else arrival_time
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            arrival_time=arrival,
            priority=priority,
            block_hasher=self._block_hasher,
        )
        record = TwinRequest(
            req_id, list(prompt_token_ids), max_tokens, priority, tenant, session, arrival
        )
        self.requests[req_id] = record
        self.scheduler.add_request(request)
        return record

    def abort(self, req_ids: Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        ids = list(req_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for req_id in ids:
            record = self.requests[req_id]
            if not record.finished:
                record.finish_reason = "abort"
                record.finish_step, record.finish_time = len(self.steps), self.now

    # -- stepping ---------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Let virtual time pass with the engine idle (e.g. a user reading)."""
        self.now += seconds

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def step(self) -> StepRecord:
        """One engine step: schedule(), a fake forward pass, update_from_output()."""
        from engine_sidecar.plugin.vllm_compat import model_runner_output

        scheduler = self.scheduler
        index = len(self.steps)
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()

        admitted = []
        for new_req in output.scheduled_new_reqs:
            twin_request = self.requests[new_req.req_id]
            if twin_request.admitted_step is None:
                twin_request.admitted_step, twin_request.admitted_time = index, self.now
                twin_request.num_cached_tokens = new_req.num_computed_tokens
                admitted.append(new_req.req_id)
        preempted = sorted(output.preempted_req_ids or ())
        for req_id in preempted:
            self.requests[req_id].num_preemptions += 1

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        num_prefill = num_decode = prefill_seqs = decode_seqs = context = 0
        context_by_req: dict[str, int] = {}
        decoding: set[str] = set()
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            computed_after = request.num_computed_tokens
            computed_before = computed_after - num_tokens
            context += computed_after
            context_by_req[req_id] = computed_after
            if num_tokens == 1 and computed_before == request.num_tokens - 1:
                num_decode += 1
                decode_seqs += 1
                decoding.add(req_id)
            else:
                num_prefill += num_tokens
                prefill_seqs += 1
            req_ids.append(req_id)
            sampled.append(
                [self._token_for(req_id, request.num_tokens)]
                if computed_after >= request.num_tokens
                else []
            )
        runner_output = model_runner_output(
            req_ids, sampled, self._transfer(output.kv_connector_metadata)
        )
        before_update = time.perf_counter()
        engine_outputs = scheduler.update_from_output(output, runner_output)
        updated = time.perf_counter()

        record = StepRecord(
            index=index,
            start_time=self.now,
            num_scheduled_tokens=dict(output.num_scheduled_tokens),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_prefill_seqs=prefill_seqs,
            num_decode_seqs=decode_seqs,
            num_context_tokens=context,
            admitted_req_ids=admitted,
            preempted_req_ids=preempted,
            finished_req_ids=[],
            num_free_blocks=scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            schedule_seconds=scheduled - started,
            update_seconds=updated - before_update,
            context_by_req=context_by_req,
            decode_req_ids=frozenset(decoding),
        )
        cost = self.config.step_cost
        record.duration = cost(record) if cost is not None else self.config.step_seconds
        self.now += record.duration
        # Tokens exist once the step is over.
        record.finished_req_ids = self._collect(engine_outputs, index, record)
        self.steps.append(record)
        return record

    def run_until_done(
        self, req_ids: Iterable[str] | None = None, *, max_steps: int = 100_000
    ) -> list[StepRecord]:
        """Step until the given requests (default: all) finish; raises on a stall."""
        wanted = list(req_ids) if req_ids is not None else None
        records: list[StepRecord] = []
        for _ in range(max_steps):
            if wanted is None and not self.has_unfinished():
                return records
            if wanted is not None and all(self.requests[r].finished for r in wanted):
                return records
            records.append(self.step())
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def kvq_stats(self) -> EngineStats:
        if self.plugin is None:
            raise TypeError("stock scheduler: no KVQuota stats")
        return self.plugin.kvq_stats()

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    def _transfer(self, metadata: Any) -> Any:
        """The offloading worker's report: every job of the step done, loads delivered."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.outputs import KVConnectorOutput

        if not isinstance(metadata, OffloadingConnectorMetadata):
            return None
        done = OffloadingWorkerMetadata()
        for job_id in (*metadata.store_jobs, *metadata.load_jobs):
            done.mark_completed(job_id)
        loaded: set[str] = set()
        for job in metadata.load_jobs.values():
            assert isinstance(job.dst_spec, GPULoadStoreSpec)
            self.requests[job.req_id].num_loaded_blocks += len(job.dst_spec.block_ids)
            loaded.add(job.req_id)
        return KVConnectorOutput(finished_recving=loaded, kv_connector_worker_meta=done)

    def _collect(self, engine_outputs: dict[int, Any], index: int, step: StepRecord
                 ) -> list[str]:
        finished = []
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                record = self.requests.get(out.request_id)
                if record is None:
                    continue
                if out.new_token_ids:
                    if record.first_token_step is None:
                        record.first_token_step, record.first_token_time = index, self.now
                        step.first_token_req_ids.append(out.request_id)
                    record.output_token_ids.extend(out.new_token_ids)
                if out.finish_reason is not None and record.finish_reason is None:
                    record.finish_reason = str(out.finish_reason)
                    record.finish_step, record.finish_time = index, self.now
                    finished.append(out.request_id)
        return finished

    def _token_for(self, req_id: str, position: int) -> int:
        """A deterministic 'sampled' token (never a special token)."""
        span = self.vocab_size - _FIRST_SAMPLED_TOKEN
        return _FIRST_SAMPLED_TOKEN + zlib.crc32(f"{req_id}:{position}".encode()) % span
