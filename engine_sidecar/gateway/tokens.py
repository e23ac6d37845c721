"""Prompt token counting with the model's own tokenizer (chat template for chat).

The local tokenizer (transformers, loaded once in the background) is the fast path.
When it cannot be loaded in the sidecar container (model files only in the engine
container, no hub access), counting falls back to the engine's `/tokenize` endpoint:
exact, but one extra round trip per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.openai_request import Kind, ParsedRequest

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized off the event loop.
INLINE_CHARS = 8_000


TokenIds = Sequence[int]


class TokenCounter(Protocol):
    description: str

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        """The prompt's token ids, per prompt (one entry for chat): their number is what
        the engine processes, their blocks are what admission deduplicates."""


def _bad_prompt(message: str, request: ParsedRequest) -> ApiError:
    return ApiError(400, errors.INVALID_REQUEST, message, param=request.prompt_param)


def _text_of(content: Any) -> Any:
    """Content parts -> text, as vLLM's 'string' content format joins them."""
    if not isinstance(content, list):
        return content
    return "\n".join(
        part["text"] for part in content if part.get("type", "text") == "text"
    )


def _chat_options(body: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True) is not False,
        "continue_final_message": body.get("continue_final_message") is True,
    }
    if isinstance(body.get("tools"), list):
        options["tools"] = body["tools"]
    return options


class HfTokenCounter:
    """transformers tokenizer; thread-safe use through one worker thread for long input."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        # The Rust tokenizer underneath a fast tokenizer: same ids, a fraction of the
        # Python overhead of `tokenizer.encode` (which goes through batch encoding).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.description = f"local tokenizer {name}"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvq-tok")

    @classmethod
    def load(cls, name_or_path: str) -> HfTokenCounter:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), name_or_path)

    def _encode(self, text: str, special: bool) -> TokenIds:
        if self._backend is not None:
            ids: TokenIds = self._backend.encode(text, add_special_tokens=special).ids
            return ids
        return list(self._tokenizer.encode(text, add_special_tokens=special))

    def _tokenize_sync(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        if request.kind is Kind.CHAT:
            messages = [{**m, "content": _text_of(m.get("content"))} for m in request.messages]
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, **_chat_options(request.body))
            special = request.body.get("add_special_tokens") is True
            return (self._encode(text, special),)
        special = request.body.get("add_special_tokens", True) is not False
        return tuple(
            p if isinstance(p, list) else self._encode(p, special) for p in request.prompts
        )

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        try:
            if _size(request) <= INLINE_CHARS:
                return self._tokenize_sync(request)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._tokenize_sync, request)
        except ApiError:
            raise
        except Exception as exc:
            raise _tokenizer_error(exc, request) from None


def _size(request: ParsedRequest) -> int:
    if request.kind is Kind.CHAT:
        return sum(len(str(m.get("content") or "")) for m in request.messages)
    return sum(len(p) for p in request.prompts)


def _tokenizer_error(exc: Exception, request: ParsedRequest) -> ApiError:
    if type(exc).__module__.startswith("jinja2"):
        detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return _bad_prompt(f"the model's chat template cannot render these messages: "
                           f"{detail}", request)
    logger.debug("tokenizer refused a request: %s", type(exc).__name__)
    return _bad_prompt("the prompt cannot be tokenized (check for invalid characters or "
                       "message structure)", request)


class EngineTokenCounter:
    """vLLM's POST /tokenize: exact (same tokenizer, same template), but a round trip."""

    description = "engine /tokenize endpoint"

    def __init__(self, client: httpx.AsyncClient, model: str | None) -> None:
        self._client = client
        self._model = model

    async def _tokenize(self, payload: dict[str, Any], request: ParsedRequest) -> TokenIds:
        if self._model:
            payload["model"] = self._model
        try:
            response = await self._client.post("/tokenize", json=payload)
        except httpx.HTTPError:
            raise ApiError(503, errors.ENGINE_UNAVAILABLE,
                           "the inference engine is not reachable; retry later",
                           retry_after=1) from None
        if response.status_code == 200:
            tokens = response.json().get("tokens")
            if isinstance(tokens, list):
                return tokens
        if 400 <= response.status_code < 500:
            try:
                message = str(response.json()["error"]["message"])[:300]
            except (ValueError, KeyError, TypeError):
                message = "the engine could not tokenize the prompt"
            raise _bad_prompt(message, request)
        raise ApiError(502, errors.UPSTREAM_ERROR,
                       "the inference engine failed to tokenize the prompt")

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        if request.kind is Kind.CHAT:
            payload: dict[str, Any] = {"messages": request.messages,
                                       **_chat_options(request.body)}
            if request.body.get("add_special_tokens") is True:
                payload["add_special_tokens"] = True
            return (await self._tokenize(payload, request),)
        special = request.body.get("add_special_tokens", True) is not False
        prompts: list[TokenIds] = []
        for prompt in request.prompts:
            if isinstance(prompt, list):
                prompts.append(prompt)
            else:
                prompts.append(await self._tokenize(
                    {"prompt": prompt, "add_special_tokens": special}, request))
        return tuple(prompts)
