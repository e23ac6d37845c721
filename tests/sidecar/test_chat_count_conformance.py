"""Chat prompts: the sidecar's count and its ceiling agree with the real engine.

The sidecar counts chat prompts with the engine's /tokenize (vLLM's own rendering) and
bounds them, before they are counted, by the text its own renderer (`chat_render`)
makes of them. Over a deterministic corpus of chat and /v1/responses shapes
(`chat_corpus`), sent through the real sidecar to the real vLLM CPU engine with the
official SDK: every count equals the engine's `usage.prompt_tokens` (`input_tokens`),
the local rendering encodes to that many tokens too (the renderer's conformance with
vLLM's, which the ceiling relies on), and the ceiling is never below it. One mismatch
fails the test, since a count or a ceiling too low lets a tenant hold more KV than its
quota.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine_sidecar.gateway.counting.prompt_count import PromptCounting
from engine_sidecar.gateway.counting.token_pool import TokenizerPool
from engine_sidecar.gateway.counting.tokens import (
    EngineTokenCounter,
    HfTokenCounter,
    chat_tokenize_payload,
)
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.openai_request import Kind, ParsedRequest, parse
from engine_sidecar.gateway.intake.responses_request import parse_responses

from .chat_corpus import chat_corpus, responses_corpus
from .conftest import Harness, RecordingCounter
from .helpers import WAIT, Keys, make_policy, tenant, wait_for
from .request_shapes import create

pytestmark = pytest.mark.engine

CHATS = chat_corpus()
RESPONSES = responses_corpus()


@pytest.fixture
def local_sidecar(sidecar: Harness, tiny_model: Path, tiny_tokenizer: Any,
                  tokenizer_pool: TokenizerPool) -> Iterator[tuple[Harness, HfTokenCounter]]:
    """The session's sidecar with the tiny model's tokenizer, its renderer trusted from
    the first chat (no first requests checked against the engine)."""
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


def _local(counter: HfTokenCounter, request: ParsedRequest) -> tuple[int, int]:
    """The local rendering's token count and the ceiling taken of it."""
    assert counter.renderer is not None
    ids = counter.renderer.render(chat_tokenize_payload(request.body))
    ceilings = PromptCounting().ceilings(counter, request)
    assert ids is not None and ceilings is not None
    return len(ids), ceilings[0]


def test_chat_counts_and_ceilings_agree_with_the_engine(
    local_sidecar: tuple[Harness, HfTokenCounter], keys: Keys
) -> None:
    harness, counter = local_sidecar
    recorder = harness.counter
    mismatches = []
    with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                       max_retries=0, timeout=60) as client:
        for i, body in enumerate(CHATS):
            harness.gateway.prompts.cache.clear()
            sent = counter.chats_sent
            result = create(client, {**copy.deepcopy(body), "max_tokens": 1})
            assert counter.chats_sent == sent + 1, f"chat {i} was not counted by the engine"
            processed = result.usage.prompt_tokens
            local, ceiling = _local(counter, parse(Kind.CHAT, json.dumps(body).encode()))
            if recorder.counts[-1] != (processed,) or local != processed or ceiling < processed:
                mismatches.append((i, recorder.counts[-1], local, ceiling, processed,
                                   json.dumps(body)[:600]))
    assert counter.renderer is not None
    assert not mismatches, (len(mismatches), mismatches)


def test_responses_counts_and_ceilings_agree_with_the_engine(
    local_sidecar: tuple[Harness, HfTokenCounter], keys: Keys, engine: Any
) -> None:
    harness, counter = local_sidecar
    recorder = harness.counter
    mismatches = []
    with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                       max_retries=0, timeout=60) as client:
        for i, body in enumerate(RESPONSES):
            harness.gateway.prompts.cache.clear()
            sent = counter.chats_sent
            args = copy.deepcopy(body)
            extra = {"chat_template_kwargs": args.pop("chat_template_kwargs")} if (
                "chat_template_kwargs" in args) else None
            response = client.responses.create(model=str(engine.model), max_output_tokens=1,
                                               extra_body=extra, **args)
            assert counter.chats_sent == sent + 1, f"input {i} was not counted by the engine"
            assert response.usage is not None
            processed = response.usage.input_tokens
            local, ceiling = _local(counter, parse_responses(json.dumps(body).encode()))
            if recorder.counts[-1] != (processed,) or local != processed or ceiling < processed:
                mismatches.append((i, recorder.counts[-1], local, ceiling, processed,
                                   json.dumps(body)[:600]))
    assert counter.renderer is not None
    assert not mismatches, (len(mismatches), mismatches)


def test_a_chat_admitted_on_its_ceiling_is_counted_by_the_engine(
    local_sidecar: tuple[Harness, HfTokenCounter], keys: Keys
) -> None:
    """With its ceiling in view (the counter unwrapped), a chat that fits at its ceiling
    is admitted on it and counted afterwards by the engine's /tokenize, not rendered and
    encoded here; the count is within the ceiling, so chat ceilings stay on."""
    harness, counter = local_sidecar
    gateway = harness.gateway
    gateway.token_counter = counter
    admitted = gateway.admitter.ceiling.admissions
    with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                       max_retries=0, timeout=60) as client:
        result = create(client, {**copy.deepcopy(CHATS[0]), "max_tokens": 1})
    assert result.usage.prompt_tokens > 0
    wait_for(lambda: not gateway.admitter.ceiling.recounts, WAIT, "the count was never taken")
    assert gateway.admitter.ceiling.admissions == admitted + 1
    assert counter.chats_sent == 1 and counter.chats_verified == 0
    assert counter.renderer is not None
