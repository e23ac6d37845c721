"""Parse the parts of an OpenAI request body that admission needs, and rewrite it.

Only fields the sidecar reads or sets are validated here; everything else passes
through for vLLM to validate (its errors are OpenAI-style already). The rewrite always
overwrites `priority`, `vllm_xargs` and `cache_salt`: clients cannot choose their own
priority, tenant attribution or prefix-cache namespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError

MAX_SESSION_ID_CHARS = 256
XARG_TENANT = "kvq_tenant"
XARG_SESSION = "kvq_session"

Prompt = str | list[int]


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    prompts: list[Prompt]  # completions: each prompt; chat: empty
    messages: list[dict[str, Any]]  # chat only
    requested_max_tokens: int | None
    max_tokens_param: str
    n: int

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind is Kind.CHAT else "prompt"


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, errors.INVALID_REQUEST, message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _invalid("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    return body


def _optional_positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _invalid(f"{name} must be an integer", param=name)
    if value < 1:
        raise _invalid(f"{name} must be at least 1, got {value}", param=name)
    return int(value)


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    if "prompt" not in body or body["prompt"] is None:
        if body.get("prompt_embeds") is not None:
            raise _invalid("prompt_embeds is not supported through the KVQuota sidecar; "
                           "send prompt text or token ids", param="prompt_embeds")
        raise _invalid("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise _invalid("prompt must be a string, a non-empty list of strings, or token ids",
                   param="prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{i}] must be an object with a string role",
                           param="messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
            isinstance(part, dict) and isinstance(part.get("type", "text"), str)
            and (part.get("type", "text") != "text" or isinstance(part.get("text"), str))
            for part in content
        ):
            raise _invalid(f"messages[{i}].content must be a string or a list of content "
                           "parts", param="messages")
    return messages


def parse(kind: Kind, raw: bytes) -> ParsedRequest:
    body = load_body(raw)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise _invalid("n must be a positive integer", param="n")
    if kind is Kind.CHAT:
        messages = _messages(body)
        prompts: list[Prompt] = []
        max_tokens = _optional_positive_int(body, "max_tokens")
        completion_tokens = _optional_positive_int(body, "max_completion_tokens")
        if completion_tokens is not None:
            max_tokens, param = completion_tokens, "max_completion_tokens"
        else:
            param = "max_tokens"
    else:
        messages = []
        prompts = _prompts(body)
        max_tokens = _optional_positive_int(body, "max_tokens")
        param = "max_tokens"
    return ParsedRequest(kind, body, prompts, messages, max_tokens, param, int(n))


def session_id(headers: dict[bytes, bytes], body: dict[str, Any]) -> str | None:
    """`X-Session-Id`, else the OpenAI `user` field."""
    value: str | None = None
    raw = headers.get(b"x-session-id")
    if raw:
        value = raw.decode("latin-1").strip()
    elif isinstance(body.get("user"), str):
        value = body["user"].strip()
    return value[:MAX_SESSION_ID_CHARS] if value else None


def rewrite(
    request: ParsedRequest,
    *,
    max_tokens: int,
    priority: int,
    tenant_id: str,
    session: str | None,
    cache_salt: str | None,
) -> bytes:
    body = request.body
    if request.kind is Kind.CHAT:
        # vLLM reads max_completion_tokens first; one field, no ambiguity.
        body.pop("max_tokens", None)
        body["max_completion_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    body["priority"] = priority
    xargs: dict[str, str] = {XARG_TENANT: tenant_id}
    if session:
        xargs[XARG_SESSION] = session
    body["vllm_xargs"] = xargs
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    else:
        body.pop("cache_salt", None)
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except (ValueError, RecursionError):  # e.g. nesting deeper than the encoder allows
        raise _invalid("the request body cannot be re-encoded as JSON") from None
