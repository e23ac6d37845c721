"""/v1/responses is admitted like chat: what the sidecar refuses, and what it forwards.

A stub engine records the forwarded bodies; the counts, the reservation and the
releases against the real engine are in test_responses_engine.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine_sidecar.gateway.intake.responses_input import input_messages

from .conftest import Harness, StubFactory
from .helpers import Keys, make_policy, tenant
from .test_passthrough_tagging import RecordingEngine


@pytest.fixture
def stubbed(stub_sidecar: StubFactory, keys: Keys) -> tuple[Harness, RecordingEngine, Any]:
    harness, stub = stub_sidecar(RecordingEngine())
    harness.apply(make_policy(tenant("acme", priority=1, max_tokens=64, default_max_tokens=8)))
    assert isinstance(stub, RecordingEngine)
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                           max_retries=0, timeout=30)
    return harness, stub, client


def test_the_tenant_owns_priority_attribution_cache_salt_and_the_ceiling(
    stubbed: tuple[Harness, RecordingEngine, Any],
) -> None:
    harness, stub, client = stubbed
    client.responses.create(model="tiny", input="hi", max_output_tokens=10_000,
                            extra_body={"priority": -5, "cache_salt": "someone-elses",
                                        "vllm_xargs": {"kvq_tenant": "other"}})
    client.responses.create(model="tiny", input="again")
    first, second = stub.forwarded["/v1/responses"]
    assert first["priority"] == 1  # the tenant's, not the client's -5
    assert first["vllm_xargs"] == {"kvq_tenant": "acme", "kvq_reserved_blocks": 1,
                                   "kvq_reserved_output_tokens": 8}
    assert first.get("cache_salt") != "someone-elses"
    assert first["input"] == "hi" and "messages" not in first  # a Responses body
    assert (first["max_output_tokens"], second["max_output_tokens"]) == (64, 8)
    assert harness.wait_ledger_empty()


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "conversation so far"),
    ({"background": True}, "background", "outlive"),
    ({"truncation": "auto"}, "truncation", "fewer tokens"),
    ({"extra_body": {"request_id": "mine"}}, "request_id", "engine assigns"),
    ({"extra_body": {"prompt": {"id": "pmpt_1"}}}, "prompt", "prompt templates"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://img.test/a.png"}]}]},
     "input[0].content[0].type", "only input_text parts"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     "only message, function_call"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content", "encrypted"),
    ({"input": [{"role": "user", "content": "a", "status": "incomplete"}]},
     "input[0].status", "not a field"),
    ({"max_output_tokens": 0}, "max_output_tokens", "positive integer"),
    ({"input": []}, "input", "list of 1 to"),
])
def test_what_cannot_be_counted_is_refused_naming_the_field(
    stubbed: tuple[Harness, RecordingEngine, Any], fields: dict[str, Any], param: str,
    words: str,
) -> None:
    harness, stub, client = stubbed
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "tiny", "input": "hi", **fields})
    assert refused.value.param == param
    assert words in refused.value.message
    assert "/v1/responses" not in stub.forwarded
    assert harness.ledger_is_empty()


def test_input_items_become_the_messages_vllm_renders() -> None:
    # As vLLM 0.32's construct_input_messages: instructions first, assistant text merged
    # into the assistant turn that holds the tool call, a partial last message continued.
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages, continued = input_messages("Be brief.", [
        {"role": "user", "content": [{"type": "input_text", "text": "call f"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "It is", "annotations": []}]},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "call f"}]},
        {"role": "assistant", "reasoning": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is"},
    ]
    assert continued
    assert input_messages(None, "hi") == ([{"role": "user", "content": "hi"}], False)
