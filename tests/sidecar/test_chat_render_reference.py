"""The local renderer hands a template exactly what vLLM's renderer hands it.

The engine conformance test (`test_chat_count_conformance`) runs the tiny model's
template, which reads only roles and content. This one holds the rest to vLLM 0.32's
own code, in process: a template that reads tools, tool calls (as JSON), reasoning,
names, documents and template arguments, and loops over content parts (so vLLM
detects the "openai" content format), renders every chat of the corpus to the same
token ids through vLLM's request model, message parser and `safe_apply_chat_template`
as through the sidecar's parser and `chat_render`. Also the tiny model's own template
("string" format), and a template that names the developer role.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine_sidecar.gateway.counting.chat_render import LocalChatRenderer
from engine_sidecar.gateway.counting.tokens import chat_tokenize_payload
from engine_sidecar.gateway.intake.openai_request import Kind, parse

from .chat_corpus import chat_corpus

pytestmark = pytest.mark.engine  # imports vLLM

protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
hf_renderer = pytest.importorskip("vllm.renderers.hf")

RICH = (
    "{% if tools %}<|tools|>{{ tools | tojson }}</s>{% endif %}"
    "{% if documents %}<|docs|>{{ documents | tojson }}</s>{% endif %}"
    "{% if enable_thinking is defined %}<|think|>{{ enable_thinking }}{% endif %}"
    "{% if custom is defined %}<|custom|>{{ custom }}{% endif %}"
    "{% if reasoning_effort is defined %}<|effort|>{{ reasoning_effort }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.name is defined %}({{ m.name }}){% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}[{{ part['type'] }}:{{ part['text'] }}]"
    "{% endfor %}{% endif %}"
    "{% if m.reasoning_content is defined %}<|r|>{{ m.reasoning_content }}{% endif %}"
    "{% if m.tool_calls is defined %}<|calls|>{{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id is defined %}<|id|>{{ m.tool_call_id }}{% endif %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DEVELOPER = ("{% for m in messages %}{% if m['role'] == 'developer' %}<|dev|>{% endif %}"
             "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL_CONFIG = SimpleNamespace(
    multimodal_config=None, enable_prompt_embeds=False, revision=None,
    hf_config=SimpleNamespace(model_type="llama"), tokenizer_revision=None,
    code_revision=None, trust_remote_code=False, tokenizer="tiny", model="tiny")


def _vllm_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """vLLM 0.32's chat path (`OnlineRenderer.render_chat` / `preprocess_chat` and
    `HfRenderer.render_messages`) for an HF tokenizer, without a server."""
    request = protocol.ChatCompletionRequest(model="tiny", **copy.deepcopy(body))
    tools = [tool.model_dump() for tool in request.tools] if request.tools else None
    params = request.build_chat_params(None, "auto").with_defaults(
        {"tools": tools, "tokenize": False})
    content_format = hf_renderer.resolve_chat_template_content_format(
        None, params.chat_template_kwargs.get("tools"), "auto", tokenizer,
        model_config=MODEL_CONFIG)
    conversation, _, _ = chat_utils.parse_chat_messages(
        request.messages, MODEL_CONFIG, content_format)
    text = hf_renderer.safe_apply_chat_template(
        MODEL_CONFIG, tokenizer, conversation, **params.get_apply_chat_template_kwargs())
    ids: list[int] = tokenizer(text, add_special_tokens=request.add_special_tokens)[
        "input_ids"]
    return ids


def _local_ids(renderer: LocalChatRenderer, body: dict[str, Any]) -> list[int] | None:
    request = parse(Kind.CHAT, json.dumps(body).encode())
    return renderer.render(chat_tokenize_payload(request.body))


@pytest.mark.parametrize("template", ["tiny", "rich", "developer"])
def test_local_rendering_equals_vllms(tiny_tokenizer: Any, template: str) -> None:
    tokenizer = copy.copy(tiny_tokenizer)
    if template != "tiny":
        tokenizer.chat_template = RICH if template == "rich" else DEVELOPER
    hf_renderer._CONTENT_FORMATS.clear()  # vLLM caches formats by the tokenizer's name
    renderer = LocalChatRenderer(tokenizer)
    differing = []
    for i, body in enumerate(chat_corpus()):
        local = _local_ids(renderer, body)
        assert local is not None, f"chat {i} was not rendered locally"
        if local != _vllm_ids(tokenizer, body):
            differing.append((i, json.dumps(body)[:400]))
    assert not differing, (len(differing), differing[:5])
