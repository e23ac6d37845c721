"""From an authenticated request body to its prompts' token ids, cheapest work first.

1. The body was read under the tenant's cap (`intake.body`), after authentication.
2. Parse and vet it (`intake.openai_request`; /v1/responses: `intake.responses_request`);
   a body over SCREEN_BYTES is parsed in a tokenizer worker process, which applies
   step 3 there too, so an oversized prompt costs the event loop one copy into a pipe.
3. Refuse a prompt whose size alone proves it too long (`prompt_bounds`).
4. Look the prompt up in the token cache (`token_cache`): a retry is not tokenized again.
5. Tokenize: short prompts inline, long ones in the worker pool; chat prompts by the
   engine's /tokenize (`tokens`).
`ceilings` is the cheap alternative to steps 4 and 5: each prompt's most tokens from its
size (chat: the text rendered here, `chat_render`), which admission decides on when
that settles it, counting afterwards (`admission.admitter`).
"""

from __future__ import annotations

from engine_sidecar.gateway import json_codec
from engine_sidecar.gateway.counting.prompt_bounds import PromptLimit
from engine_sidecar.gateway.counting.token_cache import TokenCache, digest
from engine_sidecar.gateway.counting.tokens import (
    TokenCounter,
    TokenIds,
    chat_tokenize_body,
    chat_tokenize_payload,
)
from engine_sidecar.gateway.intake.openai_request import Kind, ParsedRequest, parse
from engine_sidecar.gateway.intake.responses_request import parse_responses

SCREEN_BYTES = 256 * 1024  # json.loads of this much: ~0.3 ms on the test machine


def screen(kind: Kind, raw: bytes, limit: PromptLimit, longest: int | None) -> ParsedRequest:
    """The parsed request, or the 400 that parsing or the size floor gives."""
    request = parse_responses(raw) if kind is Kind.RESPONSES else parse(kind, raw)
    error = limit.error(request, longest)
    if error is not None:
        raise error
    return request


class PromptCounting:
    def __init__(self, cache: TokenCache | None = None) -> None:
        self.cache = cache if cache is not None else TokenCache()

    async def parse(self, kind: Kind, raw: bytes, counter: TokenCounter, limit: PromptLimit
                    ) -> ParsedRequest:
        """Steps 2 and 3: a ParsedRequest whose prompts may fit `limit`, else a 400."""
        longest, pool = counter.longest_token_bytes, counter.pool
        if pool is not None and len(raw) > SCREEN_BYTES:
            return await pool.run(screen, kind, raw, limit, longest)
        return screen(kind, raw, limit, longest)

    def ceilings(self, counter: TokenCounter, request: ParsedRequest) -> tuple[int, ...] | None:
        """Each prompt's most tokens, or None when there is no bound to decide on: a
        tokenizer without a ceiling, a chat prompt not rendered here (or not yet checked
        against the engine's rendering: `tokens.VERIFY_CHATS`)."""
        ceiling = getattr(counter, "ceiling", None)
        if ceiling is None:
            return None
        if request.kind is Kind.CHAT:
            renderer = getattr(counter, "renderer", None)
            if renderer is None or getattr(counter, "unverified_chats", 1) > 0:
                return None
            text = renderer.render_text(chat_tokenize_payload(request.body))
            if text is None:
                return None
            return (ceiling.of(text, request.body.get("add_special_tokens", False) is True),)
        special = request.body.get("add_special_tokens", True) is not False
        return tuple(len(p) if isinstance(p, list) else ceiling.of(p, special)
                     for p in request.prompts)

    async def count(self, counter: TokenCounter, request: ParsedRequest, engine_model: str | None
                    ) -> tuple[TokenIds, ...]:
        """Steps 4 and 5: each prompt's token ids."""
        if request.kind is Kind.CHAT:  # the /tokenize body itself, encoded once
            material = chat_tokenize_body(request)
        else:
            material = json_codec.dumps(
                [request.body.get("add_special_tokens", True) is not False, request.prompts],
                request.strict)
        key = digest(material, counter.description, engine_model, request.kind.value)
        return await self.cache.get_or_count(key, lambda: counter.tokenize(request))

