"""The /tokenize body the sidecar counts with renders what the chat request renders.

vLLM's own request models are the reference: for every chat body the sidecar forwards,
the chat completion request and the sidecar's /tokenize request must hand the renderer
the same messages, template arguments, tools and special-token setting. The engine test
(`test_prompt_counts`) checks the counts with the tiny model's template, which ignores
tools, documents and reasoning; this checks those reach the template alike, for any.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings

from engine_sidecar.gateway.counting.tokens import chat_tokenize_payload
from engine_sidecar.gateway.intake.openai_request import Kind, parse, rewrite

from .request_shapes import chat_bodies

pytestmark = pytest.mark.engine  # imports vLLM (its request models)

protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
tokenize_protocol = pytest.importorskip("vllm.entrypoints.serve.tokenize.protocol")


def _plain(value: Any) -> Any:
    """Validated messages hold content lists as one-shot iterators (as the renderer
    consumes them): lists here, to compare."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return value
    return [_plain(v) for v in value]


def _rendering_inputs(request: Any) -> dict[str, Any]:
    params = request.build_chat_params(None, "auto")
    return {
        "messages": _plain(request.messages),
        "chat_template": params.chat_template,
        "chat_template_kwargs": params.chat_template_kwargs,
        "tools": [tool.model_dump() for tool in request.tools or []],
        "add_special_tokens": request.add_special_tokens,
    }


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(body=chat_bodies())
def test_tokenize_renders_the_chat_request(body: dict[str, Any]) -> None:
    request = parse(Kind.CHAT, json.dumps(body).encode())
    payload = chat_tokenize_payload(request.body)
    forwarded = json.loads(rewrite(request, max_tokens=1, priority=1, tenant_id="acme",
                                   session=None, cache_salt="salt"))

    chat = protocol.ChatCompletionRequest.model_validate(forwarded)
    tokenize = tokenize_protocol.TokenizeChatRequest.model_validate(payload)
    assert _rendering_inputs(tokenize) == _rendering_inputs(chat)
