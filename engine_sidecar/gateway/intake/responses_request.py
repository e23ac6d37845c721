"""A /v1/responses body as the chat prompt vLLM renders from it, so it is admitted exactly.

vLLM 0.32 turns `instructions` and `input` into chat messages
(`construct_input_messages`) and renders them with the /v1/chat/completions renderer.
The sidecar makes the same messages, item by item (`responses_input`), and counts them
like any chat prompt: the parsed request is that chat prompt (`kind` CHAT) and the
vetted Responses body is forwarded. What vLLM would run beyond the rendered prompt is
refused with a 400 naming the field: stored history and prompts, `background`,
`truncation: auto`, media, non-function tools, custom tool calls, encrypted reasoning.
gpt-oss (Harmony) rendering is not covered. The item-by-item mapping: docs/gateway.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_sidecar.gateway.intake import body_checks as bc
from engine_sidecar.gateway.intake import chat_messages
from engine_sidecar.gateway.intake.openai_request import (
    MAX_LOGPROBS,
    MAX_TOKEN_ID,
    REFUSED,
    SHARED_FIELDS,
    Kind,
    ParsedRequest,
    load_body,
    tagged,
    vet_body,
)
from engine_sidecar.gateway.intake.responses_input import input_messages

_text = bc.string(chat_messages.MAX_TEXT_CHARS)
_name = bc.string(chat_messages.MAX_NAME_CHARS)


def _function_tool(param: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") != "function":
        kind = value.get("type") if isinstance(value, dict) else value
        raise bc.invalid(f"{param}.type {bc.shown(kind)} is not supported through the "
                         "KVQuota sidecar: only function tools are (built-in and MCP tools "
                         "run more engine turns than the request it admitted)",
                         f"{param}.type")
    bc.object_with({"type": bc.anything, "name": _name, "description": _text,
                    "parameters": bc.json_object, "strict": bc.boolean}, required=["name"]
                   )(param, value)


def _tool_choice(param: str, value: Any) -> None:
    if isinstance(value, str):
        bc.one_of({"none", "auto", "required"})(param, value)
    else:
        bc.object_with({"type": bc.one_of({"function"}), "name": _name},
                       required=["type", "name"])(param, value)


def _truncation(param: str, value: Any) -> None:
    if value != "disabled":
        raise bc.invalid(f"{param} {bc.shown(value)} is not accepted through the KVQuota "
                         "sidecar: the engine would process fewer tokens than the sidecar "
                         "counted; shorten the input instead", param)


# Sampling and output options as on the chat route (`openai_request.SHARED_FIELDS`).
SHARED = ("model", "user", "stream", "temperature", "top_p", "top_k", "min_p",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "seed", "stop",
          "stop_token_ids", "logit_bias", "ignore_eos", "skip_special_tokens",
          "include_stop_str_in_output", "watermarking", "structured_outputs",
          "priority", "vllm_xargs", "cache_salt")  # the last three are overwritten
FIELDS: dict[str, bc.Check] = {
    **{name: SHARED_FIELDS[name] for name in SHARED},
    "input": bc.anything,  # parse() converts it
    "instructions": _text,
    "max_output_tokens": bc.anything,  # parse() reads and bounds it; rewrite() clamps it
    "store": bc.boolean,  # vLLM ignores it unless VLLM_ENABLE_RESPONSES_API_STORE is set
    "metadata": bc.mapping_of(bc.string(512), 16),
    # What the answer includes: no prompt or KV of its own (vLLM judges the values).
    "include": bc.list_of(bc.string(256), 64),
    "include_reasoning": bc.boolean,
    "reasoning": bc.object_with({
        "effort": bc.one_of({"none", "minimal", "low", "medium", "high", "xhigh", "max"}),
        "summary": bc.one_of({"auto", "concise", "detailed"}),
        "generate_summary": bc.one_of({"auto", "concise", "detailed"}),
    }),
    "tools": bc.list_of(_function_tool, chat_messages.MAX_TOOLS),
    "tool_choice": _tool_choice,
    "parallel_tool_calls": bc.boolean,
    "max_tool_calls": bc.integer(1, MAX_TOKEN_ID),
    "text": bc.object_with({"format": bc.json_object,
                            "verbosity": bc.one_of({"low", "medium", "high"})}),
    "truncation": _truncation,
    "service_tier": bc.one_of({"auto", "default", "flex", "scale", "priority"}),
    "prompt_cache_key": bc.string(1024),  # vLLM ignores it
    "enable_response_messages": bc.boolean,
    "chat_template_kwargs": chat_messages.check_chat_template_kwargs,
    "top_logprobs": bc.integer(0, MAX_LOGPROBS),
}
REFUSED_HERE: dict[str, str] = {
    **{name: REFUSED[name] for name in ("kv_transfer_params", "ec_transfer_params",
                                        "request_id", "session_id", "media_io_kwargs",
                                        "mm_processor_kwargs")},
    "previous_response_id": "it continues a response the engine stored, whose history the "
                            "engine adds to the prompt where the sidecar cannot count it; "
                            "send the conversation so far in `input` instead",
    "previous_input_messages": "history the engine renders itself; send the conversation "
                               "so far in `input` instead",
    "prompt": "stored prompt templates are not supported; send the text in `input`",
    "background": "background responses outlive the request that reserved their KV "
                  "blocks; send the request in the foreground (with stream for long ones)",
}
HARMLESS: dict[str, Any] = {"background": False}


@dataclass
class ResponsesRequest(ParsedRequest):
    """The chat prompt of a Responses request (`body`) and the body to forward."""

    forward: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        return "input"


def parse_responses(raw: bytes) -> ResponsesRequest:
    body, strict = load_body(raw)
    vet_body(body, FIELDS, REFUSED_HERE, HARMLESS)
    if "input" not in body:
        raise bc.invalid("input is required", param="input")
    messages, continued = input_messages(body.get("instructions"), body["input"])
    chat: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
        "add_special_tokens": True,  # vLLM's Responses renderer tokenizes with its default
    }
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if key in tool}} for tool in body["tools"]]
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    for name in ("chat_template_kwargs", "model", "user"):
        if name in body:
            chat[name] = body[name]
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(
            max_tokens, bool) or max_tokens < 1):
        raise bc.invalid("max_output_tokens must be a positive integer",
                         param="max_output_tokens")
    return ResponsesRequest(Kind.CHAT, chat, [], max_tokens, "max_output_tokens", 1, strict,
                            forward=body)


def rewrite_responses(
    request: ParsedRequest, *, max_tokens: int, priority: int, tenant_id: str,
    session: str | None, cache_salt: str | None, reserved_blocks: int | None = None,
    reserved_output: int | None = None, above_max: bool = False,
) -> bytes:
    """The Responses body for the engine: the admitted ceiling, the tenant's fields."""
    assert isinstance(request, ResponsesRequest)
    body = request.forward
    if "model" in request.body:  # the engine's name (the app mapped the public one)
        body["model"] = request.body["model"]
    body["max_output_tokens"] = max_tokens
    return tagged(body, priority=priority, tenant_id=tenant_id, session=session,
                  cache_salt=cache_salt, strict=request.strict,
                  reserved_blocks=reserved_blocks, reserved_output=reserved_output,
                  above_max=above_max)
