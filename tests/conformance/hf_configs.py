"""Offline Hugging Face model configs for vLLM's own `tests/v1/core` suite.

Those tests build `ModelConfig("facebook/opt-125m")` and the like, which resolves the
name on the Hugging Face hub. CI has no hub access, so each config is generated here
from its transformers config class, with the published architecture values the tests
depend on (layer counts, heads, context length, vocab), and written in the hub cache
layout (`models--ORG--NAME/snapshots/REV/config.json`); with `HF_HUB_OFFLINE=1` and
`HF_HUB_CACHE` pointing at it, the names resolve locally. Nothing is downloaded; no
weights are written (the scheduler tests need none).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when a config below changes: the cache is regenerated.
GENERATOR_VERSION = "1"


def _opt_125m() -> Any:
    from transformers import OPTConfig

    return OPTConfig(torch_dtype="float16", architectures=["OPTForCausalLM"])


def _opt_350m() -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16,
        word_embed_proj_dim=512, do_layer_norm_before=False, torch_dtype="float16",
        architectures=["OPTForCausalLM"],
    )


def _qwen15_7b() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
        max_window_layers=28, sliding_window=32768, use_sliding_window=False,
        vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151643, architectures=["Qwen2ForCausalLM"],
    )


def _qwen3_06b() -> Any:  # vLLM's default model (`ModelConfig()`)
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645, architectures=["Qwen3ForCausalLM"],
    )


MODELS: dict[str, Callable[[], Any]] = {
    "Qwen/Qwen3-0.6B": _qwen3_06b,
    "facebook/opt-125m": _opt_125m,
    "facebook/opt-350m": _opt_350m,
    "Qwen/Qwen1.5-7B": _qwen15_7b,
}


def write_hub_cache(hub_cache: Path) -> list[Path]:
    """Write every model's config into `hub_cache` (HF_HUB_CACHE); returns the snapshots."""
    snapshots = []
    for repo_id, make in MODELS.items():
        config = make().to_dict()
        text = json.dumps(config, indent=2, sort_keys=True)
        # A stable fake commit: the same config gets the same snapshot directory.
        revision = hashlib.sha1(f"{GENERATOR_VERSION}:{repo_id}:{text}".encode()).hexdigest()
        repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(text)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(revision)
        snapshots.append(snapshot)
    return snapshots
