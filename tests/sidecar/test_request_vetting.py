"""What reaches the engine: body fields, content parts and headers.

Against the recording stub engine, through the official `openai` client. Fields that
admission reads are vetted and the ones that would escape its accounting refused: a 400
naming the field, and the engine never sees it. Every other field reaches the engine as
sent (the engine-against-sidecar comparison over vLLM's models is test_engine_fields).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine_sidecar.gateway.app import GatewayConfig
from engine_sidecar.gateway.intake.openai_request import CHAT_FIELDS, COMPLETION_FIELDS

from .conftest import CounterFactory, Harness, start_harness
from .helpers import WAIT, Keys, ServerThread, make_policy, tenant, wait_for
from .stub_engine import StubEngine

MESSAGES = [{"role": "user", "content": "tenant quota cache"}]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


Vetting = tuple[Harness, StubEngine, openai.OpenAI]


@pytest.fixture(scope="module")
def sidecar_and_stub(
    keys: Keys, token_counter: CounterFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Vetting]:
    """One stub engine and sidecar for the module: every test here only sends requests."""
    stub = StubEngine()
    tmp = tmp_path_factory.mktemp("vetting")
    with ServerThread(stub).running() as engine:
        config = GatewayConfig(upstream=engine.url, secrets_dir=keys.dir,
                               plugin_policy_path=tmp / "plugin-policy.json",
                               engine_probe_interval=0.2)
        harness = start_harness(tmp, config, token_counter)
        try:
            wait_for(lambda: harness.gateway.monitor.up, WAIT, "stub engine not seen up")
            harness.apply(make_policy(tenant("acme", max_tokens=16)))
            with openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                               max_retries=0) as client:
                yield harness, stub, client
        finally:
            harness.stop()


@pytest.fixture
def vetting(sidecar_and_stub: Vetting) -> Vetting:
    _, stub, _ = sidecar_and_stub
    stub.received.clear()
    stub.received_headers.clear()
    return sidecar_and_stub


def _chat(client: openai.OpenAI, messages: Any = MESSAGES, **options: Any) -> Any:
    """Messages typed loosely: these tests send what the SDK's types would not allow."""
    return client.chat.completions.create(
        model="tiny", messages=messages, **{"max_tokens": 2, **options})


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    body = refused.value.body
    assert isinstance(body, dict)
    return body


REFUSED_FIELDS: list[tuple[str, Any]] = [
    ("use_beam_search", True),
    ("kv_transfer_params", {"prompt_token_ids": list(range(5, 900))}),
    ("kv_transfer_params", {"do_remote_prefill": True}),
    ("ec_transfer_params", {"x": 1}),
    ("request_id", "chosen-by-client"),
    ("session_id", "s-1"),
    ("chat_template", "{{ messages }}"),
    ("mm_processor_kwargs", {"size": 1}),
    ("truncate_prompt_tokens", 4),
    ("n", 1000),
    ("top_logprobs", -1),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("chat_template_kwargs", {"tokenize": True}),
    ("chat_template_kwargs", {"tools": []}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_FIELDS,
                         ids=[f"{f}={v!r}"[:40] for f, v in REFUSED_FIELDS])
def test_unvetted_chat_fields_are_400_naming_the_field(
    vetting: Vetting, field: str, value: Any
) -> None:
    harness, stub, client = vetting
    error = _refusal(lambda: _chat(client, extra_body={field: value}))
    assert error["code"] == "INVALID_REQUEST"
    assert error["param"] == field or error["param"].startswith(f"{field}.")
    assert field in error["message"]
    assert stub.received == []
    assert harness.wait_ledger_empty()


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", True), ("suffix", "def f():"), ("prompt_embeds", "AAAA"),
    ("kv_transfer_params", {"prompt_token_ids": [5, 6, 7]}), ("logprobs", 50),
])
def test_unvetted_completion_fields_are_400_naming_the_field(
    vetting: Vetting, field: str, value: Any
) -> None:
    _, stub, client = vetting
    error = _refusal(lambda: client.completions.create(
        model="tiny", prompt="tenant quota", max_tokens=2, extra_body={field: value}))
    assert (error["param"], error["code"]) == (field, "INVALID_REQUEST")
    assert stub.received == []


def test_fields_admission_does_not_read_reach_the_engine_as_sent(vetting: Vetting) -> None:
    _, stub, client = vetting
    chat_extra = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                  "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
                  "functions": [{"name": "f", "parameters": {"type": "object"}}],
                  "no_such_field": {"nested": [1, 2]}}
    list(_chat(client, stream=True, stream_options={"include_usage": True,
                                               "include_obfuscation": False},
          extra_body=chat_extra))
    client.completions.create(model="tiny", prompt="tenant quota", max_tokens=2,
                              extra_body={"best_of": 1, "messages": MESSAGES})
    chat, completion = stub.received
    assert {k: chat[k] for k in chat_extra} == chat_extra
    assert chat["stream_options"] == {"include_usage": True, "include_obfuscation": False}
    assert (completion["best_of"], completion["messages"]) == (1, MESSAGES)


def test_vetted_fields_reach_the_engine_and_default_ones_do_not(vetting: Vetting) -> None:
    _, stub, client = vetting
    _chat(client, max_tokens=4, temperature=0.5, n=2, seed=7, stop=["\n"], logprobs=True,
          top_logprobs=2, user="u-1",
          extra_body={"ignore_eos": True, "min_tokens": 1, "use_beam_search": False,
                      "kv_transfer_params": None, "echo": True,
                      "chat_template_kwargs": {"enable_thinking": False}})
    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, logprobs=2,
                              echo=True, extra_body={"add_special_tokens": False})
    chat, completion = stub.received
    assert set(chat) <= set(CHAT_FIELDS) and set(completion) <= set(COMPLETION_FIELDS)
    assert "use_beam_search" not in chat and "kv_transfer_params" not in chat
    assert chat["n"] == 2 and chat["chat_template_kwargs"] == {"enable_thinking": False}


CONTENT_PARTS: list[tuple[str, dict[str, Any] | str]] = [
    ("image", {"type": "image_url", "image_url": {"url": "http://example.test/a.png"}}),
    ("audio", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
    ("video", {"type": "video_url", "video_url": {"url": "http://example.test/a.mp4"}}),
    ("file", {"type": "file", "file": {"file_data": "AAAA"}}),
    ("embeds", {"type": "prompt_embeds", "data": "AAAA"}),
    ("tool reference", {"type": "tool_reference", "name": "lookup"}),
    ("input_text", {"type": "input_text", "text": "x"}),
    ("unknown type", {"type": "mystery", "text": "x"}),
    ("no type", {"text": "x"}),
    ("text with an image key", {"type": "text", "text": "x", "image_url": "http://a.test"}),
    ("text with a uuid", {"type": "text", "text": "x", "uuid": "u-1"}),
    ("bare string", "x"),
]


@pytest.mark.parametrize(("case", "part"), CONTENT_PARTS, ids=[c for c, _ in CONTENT_PARTS])
def test_content_parts_the_sidecar_cannot_count_are_400(
    vetting: Vetting, case: str, part: Any
) -> None:
    _, stub, client = vetting
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    error = _refusal(lambda: _chat(client, messages))
    assert error["param"].startswith("messages[0].content[1]"), error
    assert stub.received == []


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "ipython", "content": "x"}, "messages[0].role"),
    ({"role": "developer", "content": "x", "tools": []}, "messages[0].tools"),
    ({"role": "user", "content": "x", "task": "t"}, "messages[0].task"),
    ({"role": "assistant", "content": None, "audio": {"id": "a"}}, "messages[0].audio"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_message_keys_the_sidecar_does_not_vet_are_400(
    vetting: Vetting, message: dict[str, Any], param: str
) -> None:
    _, stub, client = vetting
    error = _refusal(lambda: _chat(client, [message]))
    assert error["param"] == param, error
    assert stub.received == []


def test_text_like_parts_and_response_messages_are_forwarded_as_sent(vetting: Vetting) -> None:
    _, stub, client = vetting
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "thinking", "thinking": "b", "closed": True}]},
        # an assistant message as the SDK returned it, sent back with the history
        {"role": "assistant", "content": None, "refusal": None, "annotations": None,
         "audio": None, "function_call": None, "reasoning_content": "because",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ]
    _chat(client, messages)
    (sent,) = stub.received
    assert sent["messages"][1] == messages[1]
    assert sent["messages"][2]["reasoning"] == "because"  # vLLM's name for it
    assert "reasoning_content" not in sent["messages"][2]


def test_only_allow_listed_headers_reach_the_engine(vetting: Vetting) -> None:
    _, stub, client = vetting
    _chat(client, extra_headers={
        "X-Request-Id": "chosen-by-client", "X-data-parallel-rank": "1",
        "X-Vllm-Priority": "-100", "X-Session-ID": "s-1",
        "endpoint-load-metrics-format": "json", "X-Forwarded-For": "10.0.0.1",
        "traceparent": TRACEPARENT, "tracestate": "vendor=1",
    })
    _chat(client, extra_headers={"traceparent": "00-zz-bad-01", "tracestate": "vendor=1"})
    traced, malformed = stub.received_headers
    # host and content-length are the sidecar's own, for its request to the engine
    # x-request-id: the one the sidecar answers with (the client's here, test_request_ids)
    assert set(traced) == {"host", "content-length", "content-type", "accept", "traceparent",
                           "tracestate", "x-request-id"}
    assert traced["traceparent"] == TRACEPARENT and traced["content-type"] == "application/json"
    assert traced["x-request-id"] == "chosen-by-client"
    assert set(malformed) == {"host", "content-length", "content-type", "accept", "x-request-id"}
