"""/v1/responses through the sidecar to the real vLLM CPU engine, with the openai SDK.

The sidecar counts a Responses request as the chat prompt vLLM renders from it and
reserves prompt + max_output_tokens blocks in the same ledger as every generation
route; vLLM's own `usage.input_tokens` is the count it must match.
"""

from __future__ import annotations

import math
import socket
from typing import Any

import httpx
import openai
import pytest

from engine_sidecar.contract.stats import SidecarStatus

from .conftest import Harness
from .helpers import FULL_RESERVATION, Keys, http_get, make_policy, tenant

pytestmark = pytest.mark.engine

HELD_INPUT = "a held response: tenant quota cache block lease"
LONG = 2000  # max_output_tokens of a held stream; the engine's max_model_len is 2048
TOOL = {"type": "function", "name": "lookup", "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}
SHAPES: dict[str, dict[str, Any]] = {
    "string": {"input": "tenant quota cache block"},
    "instructions": {"input": "lease premium", "instructions": "Answer in one word."},
    "messages": {"input": [
        {"role": "developer", "content": "You count blocks."},
        {"role": "user", "content": "how many blocks"},
        {"role": "assistant", "content": "seven"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "and now"},
                     {"type": "input_text", "text": "with a lease"}]}]},
    "partial-assistant": {"input": [
        {"role": "user", "content": "finish the sentence"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "The quota is", "annotations": []}]}]},
    "tool-call": {"tools": [TOOL], "input": [
        {"role": "user", "content": "look up quota"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use the tool"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup",
         "arguments": '{"word": "quota"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a share"}]},
    "reasoning-effort": {"input": "why blocks", "reasoning": {"effort": "low"}},
}


def _client(harness: Harness, keys: Keys, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                         max_retries=0, timeout=60, **options)


def _status(harness: Harness) -> SidecarStatus:
    return SidecarStatus.model_validate_json(
        http_get(harness.admin_url + "/kvquota/status").content)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_sidecar_counts_the_prompt_vllm_renders(
    sidecar: Harness, engine: Any, keys: Keys, shape: str,
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=16)))
    counted = len(sidecar.counter.counts)
    response = _client(sidecar, keys).responses.create(
        model=str(engine.model), max_output_tokens=2, **SHAPES[shape])
    assert response.usage is not None
    assert len(sidecar.counter.counts) == counted + 1  # counted now, not from the cache
    assert sidecar.counter.counts[-1] == (response.usage.input_tokens,)
    assert sidecar.wait_ledger_empty()


def _held_response(harness: Harness, keys: Keys, engine: Any) -> Any:
    """A streaming response that stays admitted while its client reads nothing more
    (see test_engine_contract._held_stream: logprobs make every token's event big, so
    the engine's 2,000 tokens outgrow the socket buffers between it and this client)."""
    small_window = httpx.Client(timeout=60, transport=httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]))
    client = _client(harness, keys, http_client=small_window)
    return client.responses.create(
        model=str(engine.model), input=HELD_INPUT,
        max_output_tokens=LONG, stream=True, top_logprobs=20,
        include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})


def test_a_response_reserves_its_blocks_and_over_quota_is_429(
    sidecar: Harness, engine: Any, keys: Keys,
) -> None:
    # One held response: ceil((prompt + 2000) / 32) = 63 or 64 of 100 blocks; another
    # of the same size would exceed 100. maxQueueSeconds 0: refused at once, no race
    # with the held stream's end.
    sidecar.apply(make_policy(tenant("acme", max_tokens=LONG, max_blocks_per_engine=100,
                                     max_queue_seconds=0, above_max="Never"),
                              reservation=FULL_RESERVATION))
    client = _client(sidecar, keys)
    held = _held_response(sidecar, keys, engine)
    try:
        first = next(iter(held))
        assert first.type == "response.created"
        usage = _status(sidecar).tenants["acme"].usage
        prompt = sidecar.counter.counts[-1][0]
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.create(model=str(engine.model), input="over the quota",
                                    max_output_tokens=LONG)
        with pytest.raises(openai.RateLimitError):  # the quota is the tenant's, all routes
            client.chat.completions.create(
                model=str(engine.model), max_tokens=LONG,
                messages=[{"role": "user", "content": "over the quota"}])
    finally:
        held.close()  # the client goes away mid-stream
    assert (usage.inflight, usage.reserved_blocks) == (1, math.ceil((prompt + LONG) / 32))
    assert refused.value.code == "TENANT_BLOCK_QUOTA_EXHAUSTED"
    assert refused.value.response.headers.get("retry-after")
    assert sidecar.wait_ledger_empty(30)
    # The same prompt, answered whole: what vLLM processed is what was reserved for.
    answered = client.responses.create(model=str(engine.model), max_output_tokens=1,
                                       input=HELD_INPUT)
    assert answered.usage is not None and answered.usage.input_tokens == prompt


def test_a_streamed_response_releases_its_reservation_at_the_end(
    sidecar: Harness, engine: Any, keys: Keys,
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=16)))
    stream = _client(sidecar, keys).responses.create(
        model=str(engine.model), input="stream the quota", max_output_tokens=8, stream=True)
    events = list(stream)
    assert events[-1].type == "response.completed"
    usage = events[-1].response.usage
    assert usage is not None and 0 < usage.output_tokens <= 8
    assert sidecar.counter.counts[-1] == (usage.input_tokens,)
    assert sidecar.wait_ledger_empty()
    assert _status(sidecar).tenants["acme"].usage.reserved_blocks == 0
