"""A Responses request's `instructions` and `input` as the chat messages vLLM 0.32 makes.

The same conversion as `construct_input_messages` in
vllm/entrypoints/openai/responses/utils.py, for the items the sidecar can count (see
`responses_request`); anything else is a 400 naming the item.
"""

from __future__ import annotations

from typing import Any

from engine_sidecar.gateway.intake import chat_messages
from engine_sidecar.gateway.intake.body_checks import (
    anything,
    invalid,
    list_of,
    object_with,
    one_of,
    shown,
    string,
)

MAX_ITEMS = 4096
# vLLM drops this line from a chat system message's text parts (Claude Code's
# attribution header), but not from a Responses system message's input_text parts.
BILLING_HEADER = "x-anthropic-billing-header"
PARTIAL = frozenset({"in_progress", "incomplete"})
_text = string(chat_messages.MAX_TEXT_CHARS)
_name = string(chat_messages.MAX_NAME_CHARS)
_status = one_of({"in_progress", "completed", "incomplete"})

_input_part = object_with({"type": anything, "text": _text}, required=["text"])
_output_part = object_with({"type": anything, "text": _text, "annotations": anything,
                            "logprobs": anything}, required=["text"])
_reasoning_text = object_with({"type": anything, "text": _text}, required=["text"])


def _parts(param: str, content: Any, part_type: str) -> list[str]:
    if not isinstance(content, list) or not content or len(content) > chat_messages.MAX_PARTS:
        raise invalid(f"{param} must be a string or a list of 1 to "
                      f"{chat_messages.MAX_PARTS} {part_type} parts", param)
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != part_type:
            raise invalid(f"{where}.type {shown(kind)} is not supported through the KVQuota "
                          f"sidecar here: only {part_type} parts are, whose tokens it counts "
                          "exactly (media and other parts are not admitted)", f"{where}.type")
        (_output_part if part_type == "output_text" else _input_part)(where, part)
        texts.append(part["text"])
    return texts


def _last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _message(where: str, item: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
    """Add a message item; True if it is an assistant message left partial."""
    role = item.get("role")
    content = item.get("content")
    if role == "assistant":
        object_with({"type": anything, "role": anything, "content": anything, "id": _name,
                     "status": _status, "phase": anything}, required=["content"]
                    )(where, item)
        text = content if isinstance(content, str) else _parts(
            f"{where}.content", content, "output_text")[0]
        previous = _last_assistant(messages)
        if previous is not None and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return isinstance(content, list) and item.get("status") in PARTIAL
    if role not in ("user", "system", "developer"):
        raise invalid(f"{where}.role {shown(role)} is not supported through the KVQuota "
                      "sidecar (use user, system, developer or assistant)", f"{where}.role")
    object_with({"type": anything, "role": anything, "content": anything},
                required=["content"])(where, item)
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return False
    texts = _parts(f"{where}.content", content, "input_text")
    if role == "system" and any(text.startswith(BILLING_HEADER) for text in texts):
        raise invalid(f"{where}.content: an input_text part of a system message that starts "
                      f"with {BILLING_HEADER!r} is not supported through the KVQuota sidecar "
                      "(vLLM keeps it in a Responses prompt but drops it from the chat "
                      "prompt the sidecar counts with); send it as a string", where)
    messages.append({"role": role, "content": [{"type": "text", "text": t} for t in texts]})
    return False


def _function_call(where: str, item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    object_with({"type": anything, "call_id": _name, "name": _name, "arguments": _text,
                 "id": _name, "status": _status}, required=["call_id", "name", "arguments"]
                )(where, item)
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    previous = _last_assistant(messages)
    if previous is not None:
        previous.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def _function_output(where: str, item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    object_with({"type": anything, "call_id": _name, "output": _text, "id": _name,
                 "status": _status}, required=["call_id", "output"])(where, item)
    messages.append({"role": "tool", "content": item["output"],
                     "tool_call_id": item["call_id"]})


def _reasoning(where: str, item: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
    object_with({"type": anything, "id": _name, "status": _status,
                 "summary": list_of(_reasoning_text, chat_messages.MAX_PARTS),
                 "content": list_of(_reasoning_text, chat_messages.MAX_PARTS),
                 "encrypted_content": _null_only}, required=["summary"])(where, item)
    texts = item.get("content") or item["summary"]
    reasoning = texts[0]["text"] if texts else ""
    previous = _last_assistant(messages)
    if previous is not None and previous.get("reasoning") is None:
        previous["reasoning"] = reasoning
    else:
        messages.append({"role": "assistant", "reasoning": reasoning})
    return item.get("status") in PARTIAL


def _null_only(param: str, _value: Any) -> None:
    raise invalid(f"{param} is not accepted through the KVQuota sidecar: encrypted "
                  "reasoning cannot be rendered (or counted)", param)


def input_messages(instructions: str | None, value: Any) -> tuple[list[dict[str, Any]], bool]:
    """vLLM's chat messages for `instructions` and `input`, and whether the last one is
    continued rather than answered."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages, False
    if not isinstance(value, list) or not value or len(value) > MAX_ITEMS:
        raise invalid(f"input must be a string or a list of 1 to {MAX_ITEMS} input items",
                      param="input")
    partial = False
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an input item object", where)
        kind = item.get("type", "message")
        if kind == "message":
            partial = _message(where, item, messages)
        elif kind == "function_call":
            _function_call(where, item, messages)
            partial = False
        elif kind == "function_call_output":
            _function_output(where, item, messages)
            partial = False
        elif kind == "reasoning":
            partial = _reasoning(where, item, messages)
        else:
            raise invalid(f"{where}.type {shown(kind)} is not supported through the KVQuota "
                          "sidecar: only message, function_call, function_call_output and "
                          "reasoning items are, whose tokens it counts exactly",
                          f"{where}.type")
    return messages, partial
