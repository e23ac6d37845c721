"""Which chat messages, content parts, tools and template arguments the sidecar forwards.

Every part of a chat request that the engine renders into the prompt must be one the
sidecar counts exactly: the count comes from the engine's own renderer (`counting.tokens`),
so what is vetted here is that the rendering is all there is to the request's cost.
Media parts (image, audio, video, file, embeddings) add tokens and encoder work after
rendering and are refused, as are tool references and any part or key vLLM may read
that is not listed. Text-like parts (`text`, `refusal`, `thinking`) render as text in
vLLM (`TEXT_PART_TYPES` in vllm/renderers/chat_utils.py) and are counted with it.
"""

from __future__ import annotations

from typing import Any

from engine_sidecar.gateway.intake.body_checks import (
    Check,
    anything,
    boolean,
    invalid,
    json_object,
    list_of,
    mapping_of,
    object_with,
    one_of,
    shown,
    string,
)

MAX_TEXT_CHARS = 16 * 1024 * 1024  # the body limit bounds it anyway
MAX_NAME_CHARS = 256
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_PARTS = 1024
MAX_TEMPLATE_KWARGS = 32

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_text = string(MAX_TEXT_CHARS)
_name = string(MAX_NAME_CHARS)

# Part type -> the part's check. vLLM renders each as its text (the template sees text).
CONTENT_PARTS: dict[str, Check] = {
    "text": object_with({"type": anything, "text": _text}, required=["text"]),
    "refusal": object_with({"type": anything, "refusal": _text}, required=["refusal"]),
    "thinking": object_with({"type": anything, "thinking": _text, "closed": boolean},
                            required=["thinking"]),
}


def _null_only(param: str, value: Any) -> None:
    raise invalid(f"{param} must be null (the KVQuota sidecar does not forward it)", param)


def _content_part(param: str, part: Any) -> None:
    if not isinstance(part, dict):
        raise invalid(f"{param} must be a content part object with a type", param)
    kind = part.get("type")
    check = CONTENT_PARTS.get(kind) if isinstance(kind, str) else None
    if check is None:
        raise invalid(
            f"{param}.type {shown(kind)} is not supported through the KVQuota sidecar: only "
            f"{', '.join(CONTENT_PARTS)} parts are, whose tokens it counts exactly "
            "(media and other parts are not admitted)", f"{param}.type")
    check(param, part)


def _content(param: str, value: Any) -> None:
    if isinstance(value, str):
        return
    list_of(_content_part, MAX_PARTS)(param, value)


_function_call = object_with({"name": _name, "arguments": _text}, required=["name", "arguments"])
_tool_call = object_with(
    {"id": _name, "type": one_of({"function"}), "function": _function_call},
    required=["id", "function"],
)

# Keys of a message that vLLM renders (content, name, tool calls, tool call id,
# reasoning) or ignores; the last four are keys of an OpenAI response message that
# clients send back in the history.
MESSAGE_KEYS: dict[str, Check] = {
    "role": anything,  # checked first, below
    "content": _content,
    "name": _name,
    "tool_call_id": _name,
    "tool_calls": list_of(_tool_call, MAX_TOOL_CALLS),
    "reasoning": _text,
    "reasoning_content": _text,
    "refusal": _text,
    "annotations": _null_only,
    "audio": _null_only,
    "function_call": _null_only,
}
_message_fields = object_with(MESSAGE_KEYS)


def check_messages(param: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise invalid(f"{param} must be a non-empty list", param)
    for i, message in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"{where} must be an object with a string role", where)
        if message["role"] not in ROLES:
            raise invalid(f"{where}.role {shown(message['role'])} is not supported through the "
                          f"KVQuota sidecar (use one of {', '.join(sorted(ROLES))})",
                          f"{where}.role")
        _message_fields(where, message)


def normalize_messages(messages: list[dict[str, Any]]) -> None:
    """Rename the deprecated `reasoning_content` to `reasoning`, in place.

    vLLM's chat request does so before rendering (`_normalize_messages_before`); its
    /tokenize request does not, and would render without the reasoning."""
    for message in messages:
        reasoning = message.pop("reasoning_content", None)
        if reasoning is not None and message.get("reasoning") is None:
            message["reasoning"] = reasoning


_function = object_with(
    {"name": _name, "description": _text, "parameters": json_object, "strict": boolean},
    required=["name"],
)
check_tools = list_of(
    object_with({"type": one_of({"function"}), "function": _function}, required=["function"]),
    MAX_TOOLS, min_items=1,
)


_tool_choice_mode = one_of({"none", "auto", "required"})
_named_tool_choice = object_with(
    {"type": one_of({"function"}), "function": object_with({"name": _name}, ["name"])},
    required=["function"],
)


def check_tool_choice(param: str, value: Any) -> None:
    (_tool_choice_mode if isinstance(value, str) else _named_tool_choice)(param, value)


# apply_chat_template's own parameters (transformers) and what vLLM sets itself: the
# request's top-level fields say these, where the sidecar sees and counts them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


def check_chat_template_kwargs(param: str, value: Any) -> None:
    mapping_of(anything, MAX_TEMPLATE_KWARGS)(param, value)
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise invalid(f"{param}.{key} is not accepted through the KVQuota sidecar "
                          "(use the request's own field, if it has one)", f"{param}.{key}")


check_documents = list_of(mapping_of(_text, 64), 256)
