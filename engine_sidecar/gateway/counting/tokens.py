"""Prompt token counting: the tokens the engine will process, for every request forwarded.

Completions: the model's own tokenizer, encoding each text prompt as vLLM does;
token-id prompts count as sent. Chat (and the chat prompt of a /v1/responses request):
the engine's `POST /tokenize`, sent every field that changes the rendered prompt
(`chat_tokenize_payload`): vLLM's own rendering, exact by construction. That round trip
is taken after the request is forwarded wherever admission decides on the prompt's
ceiling (`prompt_bounds.TokenCeiling`); a chat request waits for it only where the
decision depends on the count. The local renderer (`chat_render`) only bounds a chat
prompt: the first `VERIFY_CHATS` chats are also rendered here and compared with the
engine's ids, and a count above a chat's ceiling (`ceiling_missed`) turns chat ceilings
off for good, logged as an error. Where a count is exact, a bound, or not covered:
docs/gateway.md. A tokenizer asked for but not loadable is an error, not a fall-back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from engine_sidecar.gateway import errors, json_codec
from engine_sidecar.gateway.counting.prompt_bounds import (
    TokenCeiling,
    longest_token_bytes,
    token_ceiling,
)
from engine_sidecar.gateway.counting.token_pool import TokenizerPool, encode
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.openai_request import Kind, ParsedRequest
from engine_sidecar.gateway.relay.exchange import read_capped

if TYPE_CHECKING:
    from engine_sidecar.gateway.counting.chat_render import LocalChatRenderer
    from engine_sidecar.gateway.relay.exchange import Upstream

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized in the worker pool; a shorter one costs the
# event loop about a millisecond at most.
INLINE_CHARS = 2_000
# Chat requests rendered and encoded here as well as counted by the engine's /tokenize
# before a chat prompt's ceiling is taken of the local rendering (module docstring).
VERIFY_CHATS = 8
# The chat fields /tokenize takes as they are (TokenizeChatRequest in vLLM).
TOKENIZE_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "tools")


TokenIds = Sequence[int]
TOKENIZE_HEADERS = [(b"content-type", b"application/json")]
MAX_TOKENIZE_ANSWER_BYTES = 64 * 1024 * 1024


class TokenCounter(Protocol):
    description: str
    # The most bytes of text one token stands for (`prompt_bounds`), None if unbounded.
    longest_token_bytes: int | None
    pool: TokenizerPool | None  # worker processes for long prompts and huge bodies

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        """The prompt's token ids, per prompt (one entry for chat): their number is what
        the engine processes, their blocks are what admission deduplicates."""


def _bad_prompt(message: str, request: ParsedRequest) -> ApiError:
    return ApiError(400, errors.INVALID_REQUEST, message, param=request.prompt_param)


def chat_tokenize_payload(body: dict[str, Any]) -> dict[str, Any]:
    """The /tokenize body that renders the prompt a chat completion with `body` renders.

    vLLM's chat request adds `documents` and `reasoning_effort` (and, with it,
    `enable_thinking` unless the client set it) to the template arguments
    (`ChatCompletionRequest.build_chat_params`); /tokenize takes them as template
    arguments, merged the same way (request fields over `chat_template_kwargs`)."""
    payload = {name: body[name] for name in TOKENIZE_CHAT_FIELDS if name in body}
    client_kwargs: dict[str, Any] = body.get("chat_template_kwargs") or {}
    kwargs = dict(client_kwargs)
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in client_kwargs:
            kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        payload["chat_template_kwargs"] = kwargs
    return payload


def chat_tokenize_body(request: ParsedRequest) -> bytes:
    """`chat_tokenize_payload` of a chat request, encoded once per request: the token
    cache's key hashes these bytes (`prompt_count`) and the engine is sent them."""
    if request.tokenize_body is None:
        request.tokenize_body = json_codec.dumps(chat_tokenize_payload(request.body),
                                                 request.strict)
    return request.tokenize_body


class HfTokenCounter:
    """Prompts with a transformers tokenizer: short ones inline, long ones in the worker
    pool (`token_pool`); chat prompts by `chat` (the engine's /tokenize), bounded by
    their local rendering (`chat_render`) where it agrees with the engine's."""

    def __init__(self, tokenizer: Any, name: str, chat: TokenCounter,
                 pool: TokenizerPool | None = None, *, local_chat: bool = True,
                 verify_chats: int = VERIFY_CHATS) -> None:
        self._tokenizer = tokenizer
        # The Rust tokenizer underneath a fast tokenizer: same ids, a fraction of the
        # Python overhead of `tokenizer.encode` (which goes through batch encoding).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._chat = chat
        self.renderer = _local_renderer(tokenizer) if local_chat else None
        # Chat requests still to be counted both ways before the renderer bounds chats.
        self.unverified_chats = verify_chats
        self.chats_verified = 0  # chat prompts rendered here and compared (tests)
        self.chats_sent = 0  # chat prompts counted by `chat`
        self.description = f"local tokenizer {name} (chat: {chat.description})"
        self.longest_token_bytes = (longest_token_bytes(self._backend)
                                    if self._backend is not None else None)
        # The most tokens a text can have (`prompt_bounds`): admission may decide on it.
        self.ceiling: TokenCeiling | None = (token_ceiling(self._backend)
                                             if self._backend is not None else None)
        if pool is None and self._backend is not None:
            pool = TokenizerPool.for_tokenizer(self._backend)
        self.pool = pool
        # A slow (pure Python) tokenizer has no Rust side for the workers: one thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvq-tok")

    @classmethod
    def load(cls, name_or_path: str, chat: TokenCounter, *, local_chat: bool = True,
             **pool_options: Any) -> HfTokenCounter:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        pool = TokenizerPool.for_tokenizer(backend, **pool_options) if backend else None
        return cls(tokenizer, name_or_path, chat, pool, local_chat=local_chat)

    def _encode(self, text: str, special: bool) -> TokenIds:
        if self._backend is not None:
            ids: TokenIds = self._backend.encode(text, add_special_tokens=special).ids
            return ids
        return list(self._tokenizer.encode(text, add_special_tokens=special))

    def _tokenize_sync(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        special = request.body.get("add_special_tokens", True) is not False
        return tuple(
            p if isinstance(p, list) else self._encode(p, special) for p in request.prompts
        )

    async def _tokenize_long(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        if self.pool is None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._tokenize_sync, request)
        special = request.body.get("add_special_tokens", True) is not False
        texts = [p for p in request.prompts if isinstance(p, str)]
        encoded = iter(await self.pool.run(encode, texts, special))
        return tuple(p if isinstance(p, list) else next(encoded) for p in request.prompts)

    async def _encode_chat(self, text: str, special: bool) -> TokenIds:
        if len(text) <= INLINE_CHARS:
            return self._encode(text, special)
        if self.pool is None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._encode, text, special)
        return (await self.pool.run(encode, [text], special))[0]

    async def _tokenize_chat(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        self.chats_sent += 1
        engine_ids = await self._chat.tokenize(request)
        if self.renderer is not None and self.unverified_chats > 0:
            await self._verify_rendering(request, engine_ids[0])
        return engine_ids

    async def _verify_rendering(self, request: ParsedRequest, engine_ids: TokenIds) -> None:
        """Render and encode the chat here too; one difference from the engine's ids
        turns the renderer (and with it every chat ceiling) off."""
        renderer = self.renderer
        assert renderer is not None
        rendered = renderer.render_text(chat_tokenize_payload(request.body))
        if rendered is None:
            return  # not rendered here: it has no ceiling either
        special = request.body.get("add_special_tokens", False) is True
        ids: list[int] | None
        try:
            ids = list(await self._encode_chat(rendered, special))
        except ApiError:
            return  # the worker pool is busy: verified by a later chat
        except Exception as exc:  # the engine encoded it: the local copy is what failed
            logger.debug("chat prompt not encoded here: %s", type(exc).__name__)
            ids = None
        self.chats_verified += 1
        if ids == list(engine_ids):
            self.unverified_chats -= 1
            return
        self.renderer = None
        logger.error(
            "the sidecar's chat rendering differs from the engine's (%s tokens here, %d "
            "there): every chat prompt is counted by the engine before it is admitted from "
            "now on (is the engine started with --chat-template or "
            "--default-chat-template-kwargs?)", "no" if ids is None else len(ids),
            len(engine_ids))

    def ceiling_missed(self, kind: Kind, ceiling: int, count: int) -> None:
        """A prompt counted more tokens than the ceiling it was admitted on: that bound is
        not to be trusted again (chat: the local rendering; else the tokenizer's)."""
        logger.error(
            "a %s prompt counted %d tokens, above the ceiling of %d it was admitted on: "
            "such prompts are counted before they are admitted from now on", kind.value,
            count, ceiling)
        if kind is Kind.CHAT:
            self.renderer = None
        else:
            self.ceiling = None

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        if request.kind is Kind.CHAT:
            return await self._tokenize_chat(request)
        try:
            if sum(len(p) for p in request.prompts if isinstance(p, str)) <= INLINE_CHARS:
                return self._tokenize_sync(request)
            return await self._tokenize_long(request)
        except ApiError:
            raise
        except Exception as exc:
            logger.debug("tokenizer refused a request: %s", type(exc).__name__)
            raise _bad_prompt("the prompt cannot be tokenized (check for invalid "
                              "characters)", request) from None


def _local_renderer(tokenizer: Any) -> LocalChatRenderer | None:
    """The local chat renderer, or None (no template of its own, or no jinja2 here)."""
    try:
        from engine_sidecar.gateway.counting.chat_render import LocalChatRenderer
    except ImportError:
        return None
    return LocalChatRenderer.for_tokenizer(tokenizer)


class EngineTokenCounter:
    """vLLM's POST /tokenize: exact (same tokenizer, same template), but a round trip.

    Sent over the sidecar's one upstream connection pool (the data plane that streams
    completions: httptools, keep-alive), not a second HTTP client: a fraction of the
    CPU per call of httpx."""

    description = "engine /tokenize endpoint"
    longest_token_bytes: int | None = None  # the engine's vocabulary is not known here
    pool: TokenizerPool | None = None

    def __init__(self, upstream: Upstream, model: str | None) -> None:
        self._upstream = upstream
        # Spliced in front of each (JSON object) body's first field.
        self._model_field = b'"model":' + json_codec.dumps(model) + b"," if model else b""

    async def _post(self, body: bytes) -> tuple[int, bytes]:
        if self._model_field:
            body = b"{" + self._model_field + body[1:]
        response = await self._upstream.open("POST", "/tokenize", TOKENIZE_HEADERS, body)
        try:
            answer = await read_capped(response, MAX_TOKENIZE_ANSWER_BYTES, "/tokenize")
        except OSError as exc:
            raise self._upstream.failure(exc) from None
        finally:
            await response.aclose()
        return response.status_code, answer

    async def _tokenize(self, body: bytes, request: ParsedRequest) -> TokenIds:
        status, raw = await self._post(body)
        try:
            answer = json_codec.loads(raw)
        except (ValueError, RecursionError):
            answer = None
        if status == 200 and isinstance(answer, dict):
            tokens = answer.get("tokens")
            if isinstance(tokens, list):
                return tokens
        if 400 <= status < 500:
            try:
                message = str(answer["error"]["message"])[:300]
            except (KeyError, TypeError):
                message = "the engine could not tokenize the prompt"
            raise _bad_prompt(message, request)
        raise ApiError(502, errors.UPSTREAM_ERROR,
                       "the inference engine failed to tokenize the prompt")

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        if request.kind is Kind.CHAT:
            return (await self._tokenize(chat_tokenize_body(request), request),)
        special = request.body.get("add_special_tokens", True) is not False
        prompts: list[TokenIds] = []
        for prompt in request.prompts:
            if isinstance(prompt, list):
                prompts.append(prompt)
            else:
                prompts.append(await self._tokenize(json_codec.dumps(
                    {"prompt": prompt, "add_special_tokens": special}, request.strict),
                    request))
        return tuple(prompts)
