"""Parse the parts of an OpenAI request body that admission needs, vet it, and rewrite it.

The sidecar judges only what admission needs (issue 46): the fields listed below are
vetted with their check, because they are part of the prompt (counted: `prompt`,
`messages`, `tools` and what the chat template reads), change what a request reserves
(`n`, the max-tokens fields, bounded), or are set by the sidecar whatever the client sent
(`priority`, `vllm_xargs`, `cache_salt`). Fields that would take a request out of the
sidecar's accounting are refused with their reason (`REFUSED`). Every other field is
forwarded unchanged, and vLLM accepts or refuses it as it would without the sidecar
(vLLM ignores fields its request models do not name). A null value means the default
and is not forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine_sidecar.contract.names import (
    ABOVE_MAX_ARG,
    RESERVED_BLOCKS_ARG,
    RESERVED_OUTPUT_ARG,
    SESSION_ARG,
    TENANT_ARG,
)
from engine_sidecar.gateway import json_codec
from engine_sidecar.gateway.intake import chat_messages
from engine_sidecar.gateway.intake.body_checks import (
    INT64,
    Check,
    anything,
    boolean,
    integer,
    invalid,
    is_int,
    json_object,
    list_of,
    mapping_of,
    number,
    object_with,
    one_of,
    string,
    string_or_strings,
)

MAX_SESSION_ID_CHARS = 256
# More choices per request would let one request hold many scheduler slots under one
# concurrency slot; the KV of each is reserved (n times) either way.
MAX_N = 16
# vLLM's default --max-logprobs; -1 (the whole vocabulary) is refused.
MAX_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1
MAX_LIST_ITEMS = 4096

Prompt = str | list[int]


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    # The route only: its parsed request is the chat prompt vLLM renders from it
    # (`responses_request`), counted as chat.
    RESPONSES = "responses"


@dataclass
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    prompts: list[Prompt]  # completions: each prompt; chat: empty (body["messages"])
    requested_max_tokens: int | None
    max_tokens_param: str
    n: int
    # The body is standard JSON (`json_codec.loads_strict`): the fast encoder writes it.
    strict: bool = True
    # The engine /tokenize body for this chat request, encoded once (`counting.tokens`).
    tokenize_body: bytes | None = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind is Kind.CHAT else "prompt"


_token_id = integer(0, MAX_TOKEN_ID)
_token_ids = list_of(_token_id, MAX_LIST_ITEMS)
_count = integer(0, MAX_TOKEN_ID)

# Both routes: sampling and output options (vLLM's SamplingParams and response
# options) that change neither the prompt nor KV usage beyond max_tokens and n.
SHARED_FIELDS: dict[str, Check] = {
    "model": string(1024),  # mapped to the engine's name by the app
    "user": string(MAX_SESSION_ID_CHARS * 4),  # a session id source (`session_id`)
    "stream": boolean,
    # The output meter reads usage when the client asked for it; other keys are vLLM's.
    "stream_options": object_with({"include_usage": boolean,
                                   "continuous_usage_stats": boolean}, open_ended=True),
    "n": integer(1, MAX_N),
    "max_tokens": anything,  # parse() reads and bounds it; rewrite() clamps it
    "temperature": number,
    "top_p": number,
    "top_k": integer(-1, MAX_TOKEN_ID),
    "min_p": number,
    "frequency_penalty": number,
    "presence_penalty": number,
    "repetition_penalty": number,
    "length_penalty": number,
    "seed": integer(-INT64, INT64 - 1),
    "stop": string_or_strings(4096, 64),
    "stop_token_ids": _token_ids,
    "bad_words": list_of(string(4096), MAX_LIST_ITEMS),
    "allowed_token_ids": _token_ids,
    "logit_bias": mapping_of(number, MAX_LIST_ITEMS),
    "ignore_eos": boolean,
    "min_tokens": _count,
    "include_stop_str_in_output": boolean,
    "skip_special_tokens": boolean,
    "spaces_between_special_tokens": boolean,
    "watermarking": boolean,
    "prompt_logprobs": integer(0, MAX_LOGPROBS),
    "logprob_token_ids": list_of(_token_id, MAX_LOGPROBS),
    "response_format": json_object,
    "structured_outputs": json_object,
    "repetition_detection": json_object,
    "thinking_token_budget": integer(-1, MAX_TOKEN_ID),
    "stream_interval": integer(1, MAX_TOKEN_ID),
    "echo": boolean,  # prompt text (and its logprobs) in the output: no KV of its own
    "return_token_ids": boolean,
    "return_tokens_as_token_ids": boolean,
    "add_special_tokens": boolean,  # counted (`counting.tokens`)
    "priority": anything,  # overwritten
    "vllm_xargs": anything,  # overwritten
    "cache_salt": anything,  # overwritten (or dropped when the tenant shares the cache)
}
COMPLETION_FIELDS: dict[str, Check] = {
    **SHARED_FIELDS,
    "prompt": anything,  # parse() reads it (`_prompts`)
    "logprobs": integer(0, MAX_LOGPROBS),
}
CHAT_FIELDS: dict[str, Check] = {
    **SHARED_FIELDS,
    "messages": chat_messages.check_messages,
    "max_completion_tokens": anything,  # as max_tokens
    "logprobs": boolean,
    "top_logprobs": integer(0, MAX_LOGPROBS),
    "tools": chat_messages.check_tools,
    "tool_choice": chat_messages.check_tool_choice,
    "parallel_tool_calls": boolean,
    "reasoning_effort": one_of({"none", "minimal", "low", "medium", "high", "xhigh", "max"}),
    "include_reasoning": boolean,
    "add_generation_prompt": boolean,
    "continue_final_message": boolean,
    "chat_template_kwargs": chat_messages.check_chat_template_kwargs,
    "documents": chat_messages.check_documents,
    "return_prompt_text": boolean,
}
FIELDS = {Kind.COMPLETION: COMPLETION_FIELDS, Kind.CHAT: CHAT_FIELDS}

# Fields vLLM acts on that would take a request out of the sidecar's accounting.
REFUSED: dict[str, str] = {
    "use_beam_search": "vLLM runs each beam as a new engine request without the tenant's "
                       "attribution and at the default (premium) priority",
    "kv_transfer_params": "disaggregated-serving parameters are set by the serving stack; "
                          "their prompt_token_ids replace the prompt the sidecar counted",
    "ec_transfer_params": "disaggregated-serving parameters are set by the serving stack",
    "request_id": "the engine assigns request ids; a client-chosen one names the response "
                  "and can collide with another request's",
    "session_id": "send the session in the X-Session-Id header or the user field",
    "prompt_embeds": "send prompt text or token ids",
    "suffix": "fill-in-the-middle rendering changes the prompt after the sidecar counted it",
    "truncate_prompt_tokens": "the engine would process fewer tokens than the sidecar "
                              "counted and cached; shorten the prompt instead",
    "truncation_side": "prompt truncation is not supported; shorten the prompt instead",
    "chat_template": "the engine's own chat template renders every request",
    "media_io_kwargs": "media inputs are not supported",
    "mm_processor_kwargs": "media inputs are not supported",
}
# Values that are the field's default: accepted, not forwarded.
HARMLESS = {"use_beam_search": False}


def load_body(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The body's object, and whether it is standard JSON (`json_codec.loads_strict`)."""
    try:
        body, strict = json_codec.loads_strict(raw)
    except (ValueError, RecursionError):
        raise invalid("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body, strict


def vet_fields(kind: Kind, body: dict[str, Any]) -> None:
    """Drop nulls and harmless defaults; check the listed fields; refuse `REFUSED`."""
    vet_body(body, FIELDS[kind], REFUSED, HARMLESS)


def vet_body(body: dict[str, Any], allowed: dict[str, Check], refused: dict[str, str],
             harmless: dict[str, Any]) -> None:
    """`vet_fields` with a route's own lists (`responses_request` has its own)."""
    for name, value in list(body.items()):
        if value is None or (name in harmless and value is harmless[name]):
            del body[name]
            continue
        if name in refused:
            raise invalid(f"{name} is not accepted through the KVQuota sidecar: "
                          f"{refused[name]}", param=name)
        check = allowed.get(name)
        if check is not None:
            check(name, value)  # any other field goes to the engine as sent


def _optional_positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise invalid(f"{name} must be an integer", param=name)
    if value < 1:
        raise invalid(f"{name} must be at least 1, got {value}", param=name)
    return int(value)


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    if body.get("prompt") is None:
        raise invalid("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise invalid("prompt must be a string, a non-empty list of strings, or token ids "
                  "(non-negative integers)", param="prompt")


def _is_token_id(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_TOKEN_ID


def parse(kind: Kind, raw: bytes) -> ParsedRequest:
    body, strict = load_body(raw)
    vet_fields(kind, body)
    n = int(body.get("n", 1))
    if kind is Kind.CHAT:
        if "messages" not in body:
            raise invalid("messages is required", param="messages")
        chat_messages.normalize_messages(body["messages"])
        prompts: list[Prompt] = []
        max_tokens = _optional_positive_int(body, "max_tokens")
        completion_tokens = _optional_positive_int(body, "max_completion_tokens")
        if completion_tokens is not None:
            max_tokens, param = completion_tokens, "max_completion_tokens"
        else:
            param = "max_tokens"
    else:
        prompts = _prompts(body)
        max_tokens = _optional_positive_int(body, "max_tokens")
        param = "max_tokens"
    return ParsedRequest(kind, body, prompts, max_tokens, param, n, strict)


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
    reserved_blocks: int | None = None,
    reserved_output: int | None = None,
    above_max: bool = False,
) -> bytes:
    body = request.body
    if request.kind is Kind.CHAT:
        # vLLM reads max_completion_tokens first; one field, no ambiguity.
        body.pop("max_tokens", None)
        body["max_completion_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    return tagged(body, priority=priority, tenant_id=tenant_id, session=session,
                  cache_salt=cache_salt, strict=request.strict,
                  reserved_blocks=reserved_blocks, reserved_output=reserved_output,
                  above_max=above_max)


def tagged(body: dict[str, Any], *, priority: int, tenant_id: str, session: str | None,
           cache_salt: str | None, strict: bool, reserved_blocks: int | None = None,
           reserved_output: int | None = None, above_max: bool = False) -> bytes:
    """`body` with the fields only the sidecar sets, encoded for the engine (`strict`:
    it was parsed as standard JSON, see `json_codec.dumps`). `reserved_blocks`: what
    admission reserved per sequence, so the plugin can tell a victim that outgrew it
    (`reserved_output`: of which output tokens, for the plugin to take it at the
    prompt's exact length when the sidecar decided on its ceiling);
    `above_max`: admitted beyond its tenant's maxBlocks, the plugin's first victim."""
    body["priority"] = priority
    xargs: dict[str, str | int | bool] = {TENANT_ARG: tenant_id}
    if session:
        xargs[SESSION_ARG] = session
    if reserved_blocks is not None:
        xargs[RESERVED_BLOCKS_ARG] = reserved_blocks
        if reserved_output is not None:
            xargs[RESERVED_OUTPUT_ARG] = reserved_output
    if above_max:
        xargs[ABOVE_MAX_ARG] = True
    body["vllm_xargs"] = xargs
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    else:
        body.pop("cache_salt", None)
    try:
        return json_codec.dumps(body, strict)
    except (ValueError, RecursionError):  # e.g. nesting deeper than the encoder allows
        raise invalid("the request body cannot be re-encoded as JSON") from None
