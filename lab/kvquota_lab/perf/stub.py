"""The perf harnesses' streaming stub engine: vLLM's HTTP surface at a pace it is told.

Run as `python -m kvquota_lab.perf.sidecar serve-stub` (`launch.start_stub`); its
delays are fixed (`stub_app`) or an engine's at a given concurrency (`engine_pace`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from kvquota_lab.perf.load import UNIQUE

NUMBERED = re.compile(rb"request \d+")  # chat_body's last line, UNIQUE replaced


@dataclass(frozen=True)
class Pace:
    """The stub's delays, ms: before the first chunk, then between chunks."""

    ttft_ms: float
    interval_ms: float


def engine_pace(profile: Any, streams: int, prompt_tokens: int, chunks: int) -> Pace:
    """The twin's step cost (`bench.cost.CostProfile`) at `streams` concurrent requests.

    Inter-token time: one decode step of every stream, each attending its prompt and
    half its output on average. TTFT: the step that prefills the prompt beside the
    other streams' decodes (no queueing before it: the bench's streams all fit)."""
    context = streams * (prompt_tokens + chunks // 2)
    interval = profile.step_seconds(0, streams, context)
    ttft = profile.step_seconds(prompt_tokens, max(0, streams - 1), context)
    return Pace(ttft * 1000, interval * 1000)


def stub_app(ttft_ms: float, chunks: int, interval_ms: float, jitter: float = 0.0,
             tokenizer: str | None = None, memo: bool = False,
             max_model_len: int = 4096) -> Any:
    """A raw ASGI app answering like vLLM's streaming completions.

    POST /bench/pace {"ttft_ms", "interval_ms"} changes its delays (`--pace engine`
    sets them before each row).

    With `jitter`, each delay is drawn from [1 - jitter, 1 + jitter] x its mean (seeded).
    The default is fixed delays, so the upstream's own latency is a constant and the
    difference between direct and proxied runs is the sidecar's; the load generator's
    think time keeps streams out of lockstep."""
    rng = random.Random(0)
    pace = Pace(ttft_ms, interval_ms)
    tokenize = _stub_tokenizer(tokenizer, memo)
    chunk = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0,
                        "model": "stub", "choices": [{"index": 0, "text": " token",
                                                      "logprobs": None,
                                                      "finish_reason": None}]})
    event = b"data: " + chunk.encode() + b"\n\n"
    models = json.dumps({"object": "list", "data": [
        {"id": "stub", "root": "stub", "max_model_len": max_model_len}]}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal pace
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/bench/pace":
            pace = Pace(**json.loads(body))
            path = "/health"
        if path in ("/health", "/v1/models", "/tokenize"):
            payload = models if path == "/v1/models" else (
                tokenize(body) if path == "/tokenize" else b"{}")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        await asyncio.sleep(pace.ttft_ms / 1000 * rng.uniform(1 - jitter, 1 + jitter))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i in range(chunks):
            if i:
                await asyncio.sleep(pace.interval_ms / 1000
                                    * rng.uniform(1 - jitter, 1 + jitter))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def _stub_tokenizer(name: str | None, memo: bool = False) -> Any:
    """The stub's /tokenize: vLLM's answer ({count, tokens, max_model_len}); with a
    tokenizer, its real ids (chat: rendered with its chat template).

    `memo`: each body is answered as the first one of its shape was, the per-request
    number (`UNIQUE`) aside: the same ids, within a token or two of the count, for a few
    us rather than 2.2 ms of rendering (a 2k-token chat). The sidecar's work is the
    same (its cache still misses: every body differs); the stub's core then no longer
    saturates at 64+ streams, which would put the stub's queue into "added"."""
    def rough(body: bytes) -> bytes:
        count = max(1, len(body) // 4)
        return json.dumps({"count": count, "tokens": [7] * count,
                           "max_model_len": 4096}).encode()

    if name is None:
        return rough
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)

    answers: dict[bytes, bytes] = {}

    def remembered(body: bytes) -> bytes:
        shape = NUMBERED.sub(b"request", body)
        answer = answers.get(shape)
        if answer is None:
            answer = answers[shape] = real(body)
        return answer

    def real(body: bytes) -> bytes:
        request = json.loads(body)
        if "messages" in request:
            ids = render_chat(tokenizer, request["messages"],
                              request.get("add_generation_prompt", True))
        else:
            ids = tokenizer.backend_tokenizer.encode(request["prompt"]).ids
        return json.dumps({"count": len(ids), "tokens": list(ids),
                           "max_model_len": 4096}).encode()

    return remembered if memo else real


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation: bool
                ) -> list[int]:
    """A chat prompt's ids as vLLM renders them: the template's text, then encoded."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                         tokenize=False)
    ids: list[int] = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(stub_app(args.ttft_ms, args.chunks, args.interval_ms, args.jitter,
                         args.tokenizer, args.memo, args.max_model_len),
                host="127.0.0.1",
                port=args.port, log_level="warning", access_log=False)
    return 0


def chat_body(tokenizer: str, tokens: int) -> dict[str, Any]:
    """A streaming chat request whose prompt is about `tokens` tokens of the tiny model's
    tokenizer: a system prompt and a user turn of varied words, ending in a line that
    `run_load` makes unique per request (so no cache serves it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rng = random.Random(tokens)
    words = "tenant quota cache block lease premium standard free engine answer".split()
    system = "You answer questions about tenant quotas of the KV cache. " * 4
    text: list[str] = []
    while True:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": " ".join(text) + "\nrequest " + UNIQUE.decode()}]
        count = len(render_chat(tok, messages, True))
        if count >= tokens:
            return {"model": "stub", "messages": messages, "max_tokens": 16, "stream": True}
        text += [f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(
            max(1, (tokens - count) // 3))]
