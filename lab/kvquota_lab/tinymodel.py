"""`kvquota tiny-model`: a small random-weight Llama and a BPE tokenizer, made offline.

vLLM's CPU backend needs a real model directory; this one loads in seconds and makes
the KV cache, not the weights, the scarce resource. Same output for the same version:
fixed seed, fixed training text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine_sidecar.plugin.preflight import TINY_LLAMA_CONFIG

GENERATOR_VERSION = "1"
VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The pre-flight check's tiny Llama, with a vocabulary, a context and weights to match.
MODEL_CONFIG: dict[str, Any] = {
    **TINY_LLAMA_CONFIG,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_POSITIONS,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def _training_text() -> list[str]:
    words = [
        "tenant", "quota", "cache", "block", "lease", "premium", "standard", "free", "engine",
        "scheduler", "request", "token", "prompt", "answer", "session", "preempt", "evict",
        "admit", "reserve", "release", "watermark", "pool", "kubernetes", "operator",
        "sidecar", "policy", "priority", "latency", "throughput", "the", "a", "of", "to",
        "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "be", "by", "this",
        "are", "or", "from", "at", "an", "but", "not", "what", "all",
    ]
    # A fixed pseudo-random walk over the words: enough merges for a 2k vocabulary.
    lines, state = [], 12345
    for _ in range(4000):
        line = []
        for _ in range(12):
            state = (state * 1103515245 + 12345) % (2**31)
            line.append(words[state % len(words)])
        lines.append(" ".join(line) + f" {state % 997}.")
    return lines


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _write_weights(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL_CONFIG)
    model = LlamaForCausalLM(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2, sort_keys=True))
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def generate(out: str | Path) -> Path:
    """Write the model into `out` unless a complete one of this version is there."""
    out = Path(out)
    marker = out / ".kvquota-tiny-model"
    if marker.exists() and marker.read_text() == GENERATOR_VERSION:
        return out
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)
    _write_weights(out)
    marker.write_text(GENERATOR_VERSION)  # last: a half-written directory is redone
    return out


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tiny-model",
        help="generate a tiny random Llama + tokenizer (offline, deterministic)",
        description=__doc__,
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvquota.extras import require

    require("kvquota tiny-model", "torch", "tokenizers", "safetensors")
    path = generate(args.out)
    print(path)
    return 0
