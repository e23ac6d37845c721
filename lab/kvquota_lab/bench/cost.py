"""How long one engine step takes: the twin's virtual clock.

    step = overhead + prefillPerToken * prefill tokens
                    + decodePerSeq * decoding sequences
                    + attentionPerContextToken * context tokens attended

"Context tokens attended" sums, over every sequence scheduled in the step, its KV
length after the step (what attention reads). The model is linear on purpose: it has
four numbers a user can check against their own engine, and `kvquota bench
calibrate` fits them to the local CPU engine.

Built-in profile `a100-llama3-8b` (vLLM, one A100-SXM4-80GB, Llama-3-8B in BF16),
derived from public figures; the efficiencies are our assumptions, stated here:

- Llama-3-8B model card / config.json: 8.03e9 parameters, 32 layers, 32 query heads,
  8 KV heads (GQA), head_dim 128. BF16 weights: 16.1 GB. KV cache per token:
  2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB; a 16-token block is 2 MiB.
- NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense BF16 tensor; 2,039 GB/s HBM2e.
- overhead 11 ms: every step streams all weights once, 16.1 GB at 80% of peak
  bandwidth = 9.9 ms, plus ~1 ms of scheduling and launch (CUDA graphs).
- prefillPerToken 94 us: 2 x 8.03e9 = 16.1 GFLOP per token at 55% MFU (172 TFLOP/s),
  i.e. ~10.7k prompt tokens/s.
- decodePerSeq 100 us: the same 16.1 GFLOP per generated token at the lower GEMM
  efficiency of decode batches (~50% MFU).
- attentionPerContextToken 80 ns: reading 128 KiB of K/V per context token at 80% of
  the HBM bandwidth (1.63 TB/s).
- capacity: 80 GB x 0.9 (gpu-memory-utilization) - 16.1 GB weights - ~4 GB activations
  leaves ~51 GB of KV cache = ~24,000 blocks of 16 tokens (~390k tokens).
Checks: a 2,000-token prompt prefills in ~0.2 s; 128 sequences decoding at 2k context
take ~45 ms a step (~2.8k output tokens/s) — the range vLLM reports for this pair.
"""

from __future__ import annotations

import os
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

if TYPE_CHECKING:
    from kvquota_lab.twin.harness import StepRecord

PROFILE_DIR_ENV = "KVQUOTA_PROFILE_DIR"


class CostProfileError(ValueError):
    """A profile that cannot be found or read."""


class CostProfile(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    name: str
    description: str = ""
    hardware: str = ""
    model: str = ""
    overhead: float = Field(ge=0, description="Seconds per step, whatever is scheduled.")
    prefill_per_token: float = Field(ge=0, description="Seconds per prompt token computed.")
    decode_per_seq: float = Field(ge=0, description="Seconds per decoding sequence.")
    attention_per_context_token: float = Field(
        ge=0, description="Seconds per KV token attended, summed over scheduled sequences."
    )
    typical_capacity_blocks: int | None = Field(
        None, description="KV blocks one engine of this kind has (informative)."
    )
    block_size: int | None = None
    sources: list[str] = Field(default_factory=list)
    calibrated_at: datetime | None = None
    fit: dict[str, float] = Field(default_factory=dict, description="Calibration quality.")

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int
    ) -> float:
        return (
            self.overhead
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_seq * decode_seqs
            + self.attention_per_context_token * context_tokens
        )

    def __call__(self, record: StepRecord) -> float:
        """The twin harness's `step_cost`."""
        return self.step_seconds(
            record.num_prefill_tokens, record.num_decode_seqs, record.num_context_tokens
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False
        )


A100_LLAMA3_8B = CostProfile(
    name="a100-llama3-8b",
    description="vLLM on one A100-SXM4-80GB serving Llama-3-8B (BF16), from public "
    "datasheet and model-card figures with stated efficiencies",
    hardware="NVIDIA A100-SXM4-80GB",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    overhead=0.011,
    prefill_per_token=94e-6,
    decode_per_seq=100e-6,
    attention_per_context_token=80e-9,
    typical_capacity_blocks=24_000,
    block_size=16,
    sources=[
        "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e "
        "(80GB SXM)",
        "Meta Llama 3 8B model card and config.json: 8.03B parameters, 32 layers, 8 KV "
        "heads, head_dim 128",
        "assumed: 80% of peak HBM bandwidth, 55% MFU prefill, 50% MFU decode GEMMs",
    ],
)

BUILTIN: dict[str, CostProfile] = {A100_LLAMA3_8B.name: A100_LLAMA3_8B}


def user_profile_dir() -> Path:
    """Where `kvquota bench calibrate` writes profiles (searched before shipped ones)."""
    if env := os.environ.get(PROFILE_DIR_ENV):
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvquota" / "profiles"


def read_profile(path: Path) -> CostProfile:
    try:
        return CostProfile.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise CostProfileError(f"cannot read cost profile {path}: {exc}") from None


def available_profiles() -> list[str]:
    names = set(BUILTIN)
    names.update(e.name.removesuffix(".yaml") for e in _shipped_dir().iterdir()
                 if e.name.endswith(".yaml"))
    user = user_profile_dir()
    if user.is_dir():
        names.update(p.stem for p in user.glob("*.yaml"))
    return sorted(names)


def _shipped_dir() -> resources.abc.Traversable:
    return resources.files("kvquota_lab.bench").joinpath("profiles")


def load_profile(name_or_path: str) -> CostProfile:
    """A profile by file path, else by name: the user's calibrated profiles first
    (`user_profile_dir()`), then the shipped ones, then the built-in ones."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise CostProfileError(f"cost profile file {path} does not exist")
        return read_profile(path)
    user = user_profile_dir() / f"{name_or_path}.yaml"
    if user.is_file():
        return read_profile(user)
    shipped = _shipped_dir().joinpath(f"{name_or_path}.yaml")
    if shipped.is_file():
        try:
            return CostProfile.model_validate(yaml.safe_load(shipped.read_text()))
        except (yaml.YAMLError, ValidationError) as exc:
            raise CostProfileError(f"shipped cost profile {name_or_path} is broken: {exc}") \
                from None
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    raise CostProfileError(
        f"no cost profile named {name_or_path!r}; available: "
        f"{', '.join(available_profiles())} (or give a YAML file)"
    )
