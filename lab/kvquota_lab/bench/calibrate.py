"""`kvquota bench calibrate`: fit the `cpu-local` step-cost profile to this machine.

Starts stock vLLM on the CPU backend with the tiny model (no plugin, no sidecar) and
measures, with prompts of token ids so lengths are exact and nothing hits the prefix
cache:

- decode: B concurrent streams over a context of L tokens; each stream's time per
  output token is one step, `overhead + decodePerSeq * B + attention * B * context`;
  a least-squares fit over (B, L) gives those three numbers;
- prefill: one request with P prompt tokens and max_tokens=1; the slope of latency
  over P is `prefillPerToken + attentionPerContextToken` (the intercept also holds
  HTTP and tokenisation, which no step pays).

The profile is written where `--profile cpu-local` finds it first.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kvquota_lab.bench.cost import CostProfile, user_profile_dir

if TYPE_CHECKING:
    import httpx

DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 768)
DECODE_TOKENS = 48
PREFILL_LENGTHS = (64, 256, 512, 1024, 1536)
REPEATS = 3
KV_CACHE_BYTES = 64 * 1024 * 1024


def _prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(16, 2048) for _ in range(length)]


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                  max_tokens: int) -> tuple[float, float, float, int]:
    """(start, first token, last token) wall times and the number of tokens streamed."""
    from kvquota_lab.stream_client import completion_body, stream_completion

    reply = await stream_completion(client, url, completion_body(model, prompt, max_tokens))
    if reply.status != 200:
        raise RuntimeError(f"the engine answered {reply.status} ({reply.code}); see its log")
    return (reply.sent, reply.first_token or 0.0, reply.last_token or 0.0,
            len(reply.token_ids))


async def _measure(url: str, model: str) -> tuple[list[tuple[int, int, float]],
                                                  list[tuple[int, float]]]:
    import httpx

    seed = int(time.time())
    decode: list[tuple[int, int, float]] = []
    prefill: list[tuple[int, float]] = []
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:
        await _stream(client, url, model, _prompt(seed, 32), 4)  # warm-up
        for length in PREFILL_LENGTHS:
            for _ in range(REPEATS):
                seed += 1
                start, first, _, _ = await _stream(client, url, model, _prompt(seed, length), 1)
                prefill.append((length, first - start))
        for context in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                seed += 1000
                results = await asyncio.gather(*(
                    _stream(client, url, model, _prompt(seed + i, context), DECODE_TOKENS)
                    for i in range(batch)
                ))
                per_token = [(last - first) / (count - 1) for _, first, last, count in results
                             if count > 1]
                if not per_token:
                    raise RuntimeError("the engine streamed no tokens; see its log")
                decode.append((batch, context + DECODE_TOKENS // 2,
                               statistics.median(per_token)))
    return decode, prefill


def fit_profile(
    decode: list[tuple[int, int, float]], prefill: list[tuple[int, float]]
) -> CostProfile:
    """Least squares: decode steps give overhead, decodePerSeq, attention; the prefill
    slope minus attention gives prefillPerToken. Negative fits are clamped to 0."""
    import numpy as np

    rows = np.array([[1.0, b, b * ctx] for b, ctx, _ in decode])
    times = np.array([t for _, _, t in decode])
    coef, *_ = np.linalg.lstsq(rows, times, rcond=None)
    if coef[2] < 0:  # attention too small to see: refit without it
        coef2, *_ = np.linalg.lstsq(rows[:, :2], times, rcond=None)
        coef = np.array([coef2[0], coef2[1], 0.0])
    if coef[1] < 0:
        coef2, *_ = np.linalg.lstsq(rows[:, [0, 2]], times, rcond=None)
        coef = np.array([coef2[0], 0.0, coef2[1]])
    overhead, per_seq, attention = (max(float(c), 0.0) for c in coef)
    lengths = np.array([p for p, _ in prefill], dtype=float)
    latency = np.array([t for _, t in prefill])
    slope, _intercept = np.polyfit(lengths, latency, 1)
    prefill_per_token = max(float(slope) - attention, 0.0)
    predicted = rows @ np.array([overhead, per_seq, attention])
    residual = float(np.sqrt(np.mean((predicted - times) ** 2)))
    return CostProfile(
        name="cpu-local",
        description="vLLM CPU backend, tiny model (kvquota tiny-model), fitted by "
        "`kvquota bench calibrate` on this machine",
        hardware=_cpu_name(),
        model="kvquota tiny-model",
        overhead=round(overhead, 6),
        prefill_per_token=round(prefill_per_token, 9),
        decode_per_seq=round(per_seq, 9),
        attention_per_context_token=round(attention, 12),
        typical_capacity_blocks=640,
        block_size=32,
        sources=["measured: stock vLLM CPU server, token-id prompts, streamed timings"],
        calibrated_at=datetime.now(UTC).replace(microsecond=0),
        fit={"decodeRmsSeconds": round(residual, 6), "decodePoints": len(decode),
             "prefillPoints": len(prefill)},
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "local CPU"


def calibrate(run_dir: Path, say: Callable[[str], None] = print) -> CostProfile:
    from kvquota_lab.stack import Processes, engine_process, terminate_as_interrupt, tiny_model

    model = tiny_model()
    procs = Processes()
    try:
        with terminate_as_interrupt():
            engine, url = engine_process(model, run_dir, "vllm-calibrate", plugin=False,
                                         kv_cache_bytes=KV_CACHE_BYTES)
            say(f"starting stock vLLM (CPU) for calibration; log {run_dir}/vllm-calibrate.log")
            procs.start(engine).wait_http(url + "/health", 300)
            say("measuring prefill and decode steps")
            decode, prefill = asyncio.run(_measure(url, str(model)))
    finally:
        procs.stop_all()
    return fit_profile(decode, prefill)


def calibrate_command(out: Path | None, run_dir: Path | None) -> int:
    import tempfile

    target = out or user_profile_dir() / "cpu-local.yaml"
    with tempfile.TemporaryDirectory(prefix="kvquota-calibrate-") as tmp:
        try:
            profile = calibrate(run_dir or Path(tmp))
        except KeyboardInterrupt:
            print("interrupted: the engine was stopped", file=sys.stderr)
            return 130
        except RuntimeError as exc:  # the engine did not start or misbehaved
            print(f"kvquota bench calibrate: {exc}", file=sys.stderr)
            return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(profile.to_yaml())
    print(profile.to_yaml())
    print(f"wrote {target}")
    return 0
