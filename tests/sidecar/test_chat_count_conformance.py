"""Chat prompts counted in the sidecar equal what the real engine processes (#32).

The sidecar renders chat prompts itself (`chat_render`) instead of asking the engine's
/tokenize. Over a deterministic corpus of chat and /v1/responses shapes
(`chat_corpus`), sent through the real sidecar to the real vLLM CPU engine with the
official SDK, every count was made locally (not by the /tokenize fallback) and equals
the engine's `usage.prompt_tokens` (`input_tokens`): one mismatch fails the test,
since a count too low lets a tenant hold more KV than its quota. Also: the sidecar
notices an engine that renders differently (here: a counter wired to a tokenizer
whose template differs) and falls back to /tokenize instead of under-counting.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.responses_request import parse_responses
from engine_sidecar.gateway.token_pool import TokenizerPool
from engine_sidecar.gateway.tokens import EngineTokenCounter, HfTokenCounter

from .chat_corpus import chat_corpus, responses_corpus
from .conftest import Harness, RecordingCounter
from .helpers import Keys, make_policy, tenant
from .request_shapes import create

pytestmark = pytest.mark.engine

CHATS = chat_corpus()
RESPONSES = responses_corpus()


@pytest.fixture
def local_sidecar(sidecar: Harness, tiny_model: Path, tiny_tokenizer: Any,
                  tokenizer_pool: TokenizerPool) -> Iterator[tuple[Harness, HfTokenCounter]]:
    """The session's sidecar counting chat prompts only locally (no first requests
    checked against the engine: every count below is the local renderer's)."""
    gateway = sidecar.gateway
    previous = gateway.token_counter
    counter = HfTokenCounter(tiny_tokenizer, str(tiny_model),
                             EngineTokenCounter(gateway.upstream, None), tokenizer_pool,
                             verify_chats=0)
    assert counter.renderer is not None  # the tiny model's tokenizer has a template
    gateway.token_counter = RecordingCounter(counter)
    sidecar.apply(make_policy(tenant("acme", max_tokens=4)))
    try:
        yield sidecar, counter
    finally:
        gateway.token_counter = previous


def test_the_corpus_is_large_and_varied() -> None:
    assert len(CHATS) + len(RESPONSES) >= 200
    shapes = {json.dumps(body, sort_keys=True) for body in CHATS + RESPONSES}
    assert len(shapes) == len(CHATS) + len(RESPONSES)
    roles = {m["role"] for body in CHATS for m in body["messages"]}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    items = {i.get("type", "message") for b in RESPONSES if isinstance(b["input"], list)
             for i in b["input"]}
    assert items == {"message", "function_call", "function_call_output", "reasoning"}


def test_a_responses_system_part_the_chat_prompt_would_drop_is_refused() -> None:
    """vLLM drops Claude Code's billing-header line from a chat system message's text
    parts, not from a Responses system message's input_text parts: the sidecar, which
    counts the chat prompt, refuses the one shape where the two differ."""
    body = {"input": [{"role": "system", "content": [
        {"type": "input_text", "text": "x-anthropic-billing-header: cch=1\n" + "x " * 400}]},
        {"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as refused:
        parse_responses(json.dumps(body).encode())
    assert refused.value.status == 400 and "input[0].content" in str(refused.value.message)


def test_local_chat_counts_equal_the_engines(
    local_sidecar: tuple[Harness, HfTokenCounter], keys: Keys
) -> None:
    harness, counter = local_sidecar
    recorder = harness.counter
    mismatches = []
    with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                       max_retries=0, timeout=60) as client:
        for i, body in enumerate(CHATS):
            harness.gateway.prompts.cache.clear()
            local = counter.chats_rendered
            result = create(client, {**copy.deepcopy(body), "max_tokens": 1})
            assert counter.chats_rendered == local + 1, f"chat {i} was not counted locally"
            if recorder.counts[-1] != (result.usage.prompt_tokens,):
                mismatches.append((i, recorder.counts[-1], result.usage.prompt_tokens,
                                   json.dumps(body)[:600]))
    assert counter.chats_sent == 0
    assert not mismatches, (len(mismatches), mismatches)


def test_local_responses_counts_equal_the_engines(
    local_sidecar: tuple[Harness, HfTokenCounter], keys: Keys, engine: Any
) -> None:
    harness, counter = local_sidecar
    recorder = harness.counter
    mismatches = []
    with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                       max_retries=0, timeout=60) as client:
        for i, body in enumerate(RESPONSES):
            harness.gateway.prompts.cache.clear()
            local = counter.chats_rendered
            args = copy.deepcopy(body)
            extra = {"chat_template_kwargs": args.pop("chat_template_kwargs")} if (
                "chat_template_kwargs" in args) else None
            response = client.responses.create(model=str(engine.model), max_output_tokens=1,
                                               extra_body=extra, **args)
            assert counter.chats_rendered == local + 1, f"input {i} was not counted locally"
            assert response.usage is not None
            if recorder.counts[-1] != (response.usage.input_tokens,):
                mismatches.append((i, recorder.counts[-1], response.usage.input_tokens,
                                   json.dumps(body)[:600]))
    assert counter.chats_sent == 0
    assert not mismatches, (len(mismatches), mismatches)
