"""The pre-flight check: does the plugin run on the vLLM this image has?

    python -m engine_sidecar.plugin.preflight [--strict]

vLLM's scheduler interface is private and changes between releases, and the version
gate can only look for touchpoints that exist without an instance. This check builds
vLLM's real `Scheduler` with the plugin (a tiny config, no weights, no GPU, no
network) and steps it through admit, preempt, lease and finish. It prints `ok: ...`
and exits 0, or names each missing touchpoint and exits 1; `--strict` also fails
where the plugin would refuse to start (the injected init container uses it). It
imports only vLLM and this package: it runs inside the vLLM container.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.names import (
    POLICY_PATH_ENV,
    PREFLIGHT_STRICT_FLAG,
    SESSION_ARG,
    STATS_PATH_ENV,
    TENANT_ARG,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from engine_sidecar.plugin.scheduler import TenantAwareScheduler

STAGES = ("admit", "preempt", "lease", "finish")
BLOCK_SIZE = 16
NUM_BLOCKS = 21  # block 0 is vLLM's null block: 20 usable
MAX_STEPS = 300  # per stage; every stage needs well under 100
_TOKEN = 100  # what every fake step samples (not a special token of the tiny model)
# A tiny Llama: only its shape is read (no weights); head_dim 64 is what vLLM's CPU
# attention accepts.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class StageFailed(Exception):
    """The scheduler ran but did not do what the stage expects."""


def write_model_config(directory: Path) -> Path:
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return directory


def write_policy(path: Path) -> Path:
    """Two tenants: premium (priority 0, leases idle sessions for 5 minutes) and free
    (priority 2, no guarantee: every block it holds is borrowed)."""
    from engine_sidecar.contract.policy import EnginePolicy, LeasePolicy, TenantPolicy, Tier

    tenants = [
        TenantPolicy(tenant_id="premium", tier=Tier.PREMIUM, priority=0,
                     guaranteed_blocks=NUM_BLOCKS, max_blocks_per_engine=NUM_BLOCKS,
                     lease=LeasePolicy(seconds=300), max_tokens=64, default_max_tokens=8),
        TenantPolicy(tenant_id="free", tier=Tier.FREE, priority=2, guaranteed_blocks=0,
                     max_blocks_per_engine=NUM_BLOCKS, max_tokens=64, default_max_tokens=8),
    ]
    policy = EnginePolicy(pool="preflight/check", model="tiny", block_size=BLOCK_SIZE,
                          tenants={t.tenant_id: t for t in tenants}).with_version()
    path.write_text(policy.to_json())
    return path


class CheckedScheduler:
    """The plugin on vLLM's real scheduler, stepped with fake model outputs."""

    def __init__(self, model_dir: Path) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        from engine_sidecar.plugin.scheduler import TenantAwareScheduler

        vllm_config = _vllm_config(model_dir)
        self.scheduler: TenantAwareScheduler = TenantAwareScheduler(
            vllm_config=vllm_config,
            kv_cache_config=_kv_cache_config(vllm_config),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.requests: dict[str, Request] = {}

    def add(self, req_id: str, tenant: str, priority: int, num_prompt_tokens: int,
            max_tokens: int) -> Request:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                extra_args={TENANT_ARG: tenant, SESSION_ARG: req_id})
        # Distinct prompts: no request starts with another's prefix.
        offset = 16 + 256 * len(self.requests)
        request = Request(
            request_id=req_id,
            prompt_token_ids=[offset + i % 256 for i in range(num_prompt_tokens)],
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(len(self.requests)),
            priority=priority,
            block_hasher=self._block_hasher,
        )
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        """schedule(), a forward pass that samples one token for every request whose
        prompt is computed, update_from_output()."""
        from engine_sidecar.plugin.vllm_compat import model_runner_output

        output = self.scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            sampled.append([_TOKEN] if request.num_computed_tokens >= request.num_tokens
                           else [])
        self.scheduler.update_from_output(output, model_runner_output(req_ids, sampled))

    def step_until(self, done: Callable[[], bool], what: str) -> None:
        for _ in range(MAX_STEPS):
            if done():
                return
            self.step()
        raise StageFailed(f"{what}: not so after {MAX_STEPS} steps")

    def run(self, stage: str) -> None:
        """One stage of the check; raises StageFailed when the scheduler did not do
        what the plugin promises."""
        from vllm.v1.request import RequestStatus

        requests = self.requests
        if stage == "admit":
            for name in ("free-a", "free-b"):
                self.add(name, "free", 2, num_prompt_tokens=64, max_tokens=24)
            # Both prefilled and decoding: each holds 5 of the 20 blocks.
            self.step_until(lambda: all(r.num_computed_tokens > 64 for r in requests.values()),
                            "the two free-tier requests are admitted and decode")
        elif stage == "preempt":
            # 11 blocks for the prompt: more than the 10 free ones.
            self.add("premium", "premium", 0, num_prompt_tokens=11 * BLOCK_SIZE, max_tokens=4)
            self.step_until(lambda: requests["premium"].num_output_tokens > 0,
                            "the premium request is admitted")
            _expect(any(requests[r].num_preemptions for r in ("free-a", "free-b")),
                    "the premium request found no room, yet no free-tier request was "
                    "preempted")
        elif stage == "lease":
            premium = requests["premium"]
            self.step_until(premium.is_finished, "the premium request finishes")
            _expect(premium.num_preemptions == 0, "the premium request was preempted")
            stats = self.scheduler.kvq_stats().tenants["premium"]
            full_blocks = premium.num_computed_tokens // BLOCK_SIZE
            _expect(stats.leased_sessions == 1 and stats.leased_blocks == full_blocks,
                    f"the finished premium session should keep its {full_blocks} blocks "
                    f"pinned; leased: {stats.leased_sessions} session(s), "
                    f"{stats.leased_blocks} blocks")
        elif stage == "finish":
            self.step_until(lambda: not self.scheduler.has_unfinished_requests(),
                            "every request finishes")
            for name in ("free-a", "free-b"):
                request = requests[name]
                _expect(request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                        and request.num_output_tokens == 24,
                        f"{name} should finish with its 24 tokens; status "
                        f"{request.status.name}, {request.num_output_tokens} tokens")
            engine = self.scheduler.kvq_stats()
            leased = engine.tenants["premium"].leased_blocks
            _expect(leased > 0 and engine.free_blocks == engine.total_blocks - leased,
                    f"after every request finished, {engine.free_blocks} of "
                    f"{engine.total_blocks} blocks are free and {leased} leased")

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise StageFailed(message)


def _vllm_config(model_dir: Path) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32")
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=2048,
            max_model_len=model_config.max_model_len, is_encoder_decoder=False,
            policy="priority", enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.scheduler_config.async_scheduling = False
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vllm_config


def _kv_cache_config(vllm_config: Any) -> Any:
    """One full-attention group over the model's layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=TINY_LLAMA_CONFIG["num_key_value_heads"],
        head_size=vllm_config.model_config.get_head_size(),
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn"
              for i in range(TINY_LLAMA_CONFIG["num_hidden_layers"])]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def describe(exc: BaseException) -> str:
    """What a user (or whoever ports the plugin) needs: the attribute that is missing,
    on the vLLM class that lacks it, or the error; and where it was raised."""
    if isinstance(exc, AttributeError) and exc.name:
        what = f"missing attribute {_vllm_owner(exc.obj)}.{exc.name}"
    else:
        what = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return what
    frame = frames[-1]
    path = frame.filename.replace(os.sep, "/")
    for root in ("/vllm/", "/engine_sidecar/"):
        if root in path:
            path = path[path.rindex(root) + 1:]
            break
    return f"{what} (at {path}:{frame.lineno} in {frame.name})"


def _vllm_owner(obj: Any) -> str:
    """The class a missing attribute was looked up on: the vLLM class the plugin's
    subclass extends, rather than the subclass."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    cls = obj if isinstance(obj, type) else type(obj)
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "vllm":
            return base.__name__
    return cls.__name__


@contextlib.contextmanager
def _scoped(env: dict[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables and mute log records below ERROR for
    the check's own scheduler; restored afterwards (the CLI runs it in process)."""
    saved = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def step_through(allow_unverified: bool) -> list[str]:
    """Build the scheduler and run every stage; the problems met (none: ok). Stops at
    the first failing stage: each one starts from where the last left off."""
    from engine_sidecar.plugin.vllm_compat import ALLOW_UNSUPPORTED_ENV

    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvquota-preflight-") as tmp, _scoped({
        # The check's own policy; never the engine's stats file (when run by hand in
        # the engine's container, those variables name the live engine's files).
        POLICY_PATH_ENV: str(write_policy(Path(tmp) / "policy.json")),
        STATS_PATH_ENV: None,
        ALLOW_UNSUPPORTED_ENV: "1" if allow_unverified else None,
    }):
        stage = "build"
        checked: CheckedScheduler | None = None
        try:
            checked = CheckedScheduler(write_model_config(Path(tmp)))
            for stage in STAGES:
                checked.run(stage)
        except StageFailed as exc:
            problems.append(f"{stage}: {exc}")
        except Exception as exc:  # whatever this vLLM raises: name it, with the stage
            problems.append(f"{stage}: {describe(exc)}")
        finally:
            if checked is not None:
                with contextlib.suppress(Exception):
                    checked.shutdown()
    return problems


def run_check(strict: bool = False) -> tuple[bool, list[str]]:
    """(ok, the lines to print)."""
    try:
        import vllm
    except ImportError as exc:
        return False, [f"not ok: vLLM cannot be imported here ({exc}); run the check in "
                       "the engine's image, with the plugin's directory on PYTHONPATH"]
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from engine_sidecar.plugin import vllm_compat
    except ImportError as exc:  # a module or name the plugin imports has moved
        return False, [f"missing touchpoint: {exc}",
                       f"not ok: vLLM {version}: the plugin cannot import its touchpoints"]
    package = Path(__file__).resolve().parents[1]  # engine_sidecar/, as installed
    lines = [f"checking the plugin at {package} on vLLM {version} at "
             f"{Path(vllm.__file__).resolve().parent}"]
    verified = vllm_compat.is_supported_version(version)
    allowed = os.environ.get(vllm_compat.ALLOW_UNSUPPORTED_ENV) == "1"
    if not verified:
        lines.append(
            f"note: vLLM {version} is not a verified release "
            f"({', '.join(vllm_compat.VERIFIED_VLLM)}); the plugin starts on it only with "
            f"{vllm_compat.ALLOW_UNSUPPORTED_ENV}=1"
            + (" (set here)" if allowed else ""))
    problems = [f"missing touchpoint: {name}" for name in vllm_compat.missing_touchpoints()]
    if not problems:  # with any missing, the gate refuses to build the scheduler
        problems = step_through(allow_unverified=not verified)
    if problems:
        return False, [*lines, *problems,
                       f"not ok: vLLM {version}: the plugin does not run on it; install a "
                       f"verified release ({', '.join(vllm_compat.VERIFIED_VLLM)})"]
    lines.append(f"ok: vLLM {version}: {', '.join(STAGES)}")
    if strict and not verified and not allowed:
        lines.append(f"not ok: the plugin refuses to start on vLLM {version} unless the "
                     f"engine's container sets {vllm_compat.ALLOW_UNSUPPORTED_ENV}=1")
        return False, lines
    return True, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_sidecar.plugin.preflight",
        description="Step vLLM's real scheduler with the KVQuota plugin through admit, "
                    "preempt, lease and finish (no model, no GPU, no network).")
    parser.add_argument(PREFLIGHT_STRICT_FLAG, action="store_true",
                        help="also fail where the plugin would refuse to start: a vLLM "
                             "that is not a verified release, unless "
                             "KVQUOTA_ALLOW_UNSUPPORTED_VLLM=1 (the injected init "
                             "container runs this)")
    args = parser.parse_args(argv)
    ok, lines = run_check(strict=args.strict)
    stream = sys.stdout if ok else sys.stderr
    for line in lines:
        print(line, file=stream, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
