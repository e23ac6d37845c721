"""pytest plugin (`-p vllm_swap`) for running vLLM's own `tests/v1/core` suite.

`KVQUOTA_CONFORMANCE_SCHEDULER=plugin` puts KVQuota's TenantAwareScheduler (and its
async variant) in place of vLLM's `Scheduler` / `AsyncScheduler` before any test module
imports them by name; `stock` leaves vLLM's classes. No policy file: the conformance
check is that the plugin changes nothing when no tenant is involved.

Tests that name a model this environment cannot build are deselected with the reason
(see UNAVAILABLE_MODELS); every test also gets vLLM's own `skip_global_cleanup` marker
(the scheduler tests start no distributed state, and the per-test `gc.collect()` of a
heap holding torch and transformers costs more than most of the tests).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

SCHEDULER_ENV = "KVQUOTA_CONFORMANCE_SCHEDULER"
NO_PLATFORM_ENV = "KVQUOTA_CONFORMANCE_NO_PLATFORM"  # "1": a release without a CPU build
CHOICES = ("plugin", "stock")

# The multimodal model classes import torchvision, which the `engine` extra's setup
# removes (beside torch 2.13.0+cpu it breaks `import transformers`); e2e tests start
# an engine with real weights from the Hugging Face hub, which CI cannot reach.
_NO_TORCHVISION = "multimodal model class needs torchvision (not installed beside torch+cpu)"
_NEEDS_WEIGHTS = "starts an engine with real weights from the Hugging Face hub"
UNAVAILABLE_MODELS = {
    "llava-hf/llava-1.5-7b-hf": _NO_TORCHVISION,
    "Qwen/Qwen2.5-VL-3B-Instruct": _NO_TORCHVISION,
    "hmellor/tiny-random-LlamaForCausalLM": _NEEDS_WEIGHTS,
    "Qwen/Qwen3.5-0.8B": _NEEDS_WEIGHTS,
    # vLLM 0.34: a hybrid (linear attention) model whose config hf_configs does not
    # generate; the test fails stock too.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "hybrid model config not generated offline",
}
# Tests that cannot run here, neither about the scheduler.
UNAVAILABLE_TESTS = {
    # Timed by the machine's speed (a subprocess that must import vLLM within 60 s):
    # on a loaded CI machine it fails either way.
    "test_kv_cache_utils.py::test_is_kv_cache_spec_uniform": "a 60 s subprocess timeout",
    # vLLM 0.34: compares with the Rust frontend's fixture, outside tests/ (not fetched).
    "test_prompt_block_hash_vectors.py::test_engine_matches_frontend_prompt_block_hash_vectors":
        "reads a fixture of vLLM's Rust frontend, outside tests/",
}
# Files whose tests start an engine (LLM / an OpenAI server) with weights.
ENGINE_FILES = {
    "test_scheduler_e2e.py": _NEEDS_WEIGHTS,
    "test_reset_prefix_cache_e2e.py": _NEEDS_WEIGHTS,
    "test_hybrid_prefix_cache_hit_rate.py": _NEEDS_WEIGHTS,
}


def _choice() -> str:
    choice = os.environ.get(SCHEDULER_ENV, "")
    if choice not in CHOICES:
        raise pytest.UsageError(f"{SCHEDULER_ENV} must be one of {CHOICES}, not {choice!r}")
    return choice


def _swap() -> None:
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    from engine_sidecar.plugin.scheduler import AsyncTenantAwareScheduler, TenantAwareScheduler

    scheduler_module.Scheduler = TenantAwareScheduler  # type: ignore[misc]
    async_module.AsyncScheduler = AsyncTenantAwareScheduler  # type: ignore[misc]


def _cpu_without_platform() -> None:
    """A release without a CPU build (its GPU wheel's Python code, unpacked) finds no
    platform here, and its CPU platform demands triton-cpu for the model runner. The
    scheduler tests run no kernels: they only need `DeviceConfig("auto")` to resolve, so
    the fallback platform names the CPU as its device, in both runs alike."""
    from vllm.platforms.interface import UnspecifiedPlatform

    UnspecifiedPlatform.device_type = "cpu"


# At import, i.e. before conftest files and test modules bind the names.
if os.environ.get(NO_PLATFORM_ENV) == "1":
    _cpu_without_platform()
if _choice() == "plugin":
    _swap()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Engine files are not even imported: on a release whose wheel ships no CPU build
    their server imports need packages (orjson, ...) that only the engine needs."""
    reason = ENGINE_FILES.get(collection_path.name)
    if reason is None:
        return None
    config.stash.setdefault(_IGNORED, {})[collection_path.name] = reason
    return True


def unavailable_reason(item: pytest.Item) -> str | None:
    reason = UNAVAILABLE_TESTS.get(
        f"{item.path.name}::{item.name}"
    )
    if reason is not None:
        return reason
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    params = getattr(getattr(item, "callspec", None), "params", {})
    text = source + " " + " ".join(map(str, params.values()))
    for model, why in UNAVAILABLE_MODELS.items():
        if model in text:
            return f"{why} ({model})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        reason = unavailable_reason(item)
        if reason is None:
            item.add_marker(pytest.mark.skip_global_cleanup)
            kept.append(item)
        else:
            dropped.append(item)
            config.stash.setdefault(_DROPPED, {})[item.nodeid] = reason
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_DROPPED = pytest.StashKey[dict[str, str]]()
_IGNORED = pytest.StashKey[dict[str, str]]()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    dropped = config.stash.get(_DROPPED, {})
    reasons: dict[str, int] = {}
    for reason in dropped.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_line(f"scheduler: {_choice()}; deselected {len(dropped)}:")
    for reason, count in sorted(reasons.items()):
        terminalreporter.write_line(f"  {count:4d}  {reason}")
    for name, reason in sorted(config.stash.get(_IGNORED, {}).items()):
        terminalreporter.write_line(f"   not collected: {name} ({reason})")
