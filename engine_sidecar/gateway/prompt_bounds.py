"""A prompt's token count bounded from below by its size, before anything is tokenized.

A token stands for at most `longest` bytes of text (the longest token of the vocabulary),
so a prompt of B bytes has at least ceil(B / longest) tokens. When that floor is already
over the tenant's `maxPromptTokens` or the model's context, the request is refused (400,
PROMPT_TOO_LONG) at the cost of measuring string lengths: a 10 MB prompt is never
tokenized (issue #13, finding 2).

The floor holds when no token can cover more input bytes than its own spelling:
- byte-level BPE (GPT-2 style) and SentencePiece-style pieces spell each byte with at
  least one character, so a token's UTF-8 spelling is at least the bytes it covers;
- a normalizer can shrink text before it is split (NFKC composes, lowercasing can
  shorten): a tokenizer with one gets NORMALIZER_FACTOR times the margin;
- an unknown-token id that swallows a run of characters (`fuse_unk`, Unigram without
  byte fallback, WordPiece, WordLevel) has no bound: no floor is used for such a
  tokenizer, and its prompts are only tokenized (off the event loop).

Chat prompts: the floor counts the text of the messages' content, which every chat
template renders; the template only adds to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.openai_request import Kind, ParsedRequest

NORMALIZER_FACTOR = 4
BYTE_FALLBACK_TOKENS = frozenset(f"<0x{b:02X}>" for b in range(256))
TEXT_PART_KEYS = ("text", "refusal", "thinking")


def longest_token_bytes(backend: Any) -> int | None:
    """The most input bytes one token of this `tokenizers.Tokenizer` can stand for, or
    None when unknown tokens can swallow runs of text (no bound)."""
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    model = backend.model
    kind = type(model).__name__
    byte_fallback = (bool(getattr(model, "byte_fallback", False))
                     or vocab.keys() >= BYTE_FALLBACK_TOKENS)
    unk = getattr(model, "unk_token", None)
    if kind == "BPE":
        if getattr(model, "fuse_unk", False) and unk and not byte_fallback:
            return None
    elif not byte_fallback:  # Unigram fuses unknown runs; WordPiece/WordLevel map words
        return None
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)
    longest = max(longest, 4)  # an unfused unknown token covers one character
    if backend.normalizer is not None:
        longest *= NORMALIZER_FACTOR
    return longest


def text_bytes(text: str) -> int:
    """UTF-8 length; O(1) for ASCII text."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _content_texts(messages: Iterable[Any]) -> Iterator[str]:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    for key in TEXT_PART_KEYS:
                        if isinstance(part.get(key), str):
                            yield part[key]


def prompt_bytes(request: ParsedRequest) -> list[int]:
    """Bytes of text in each text prompt (chat: one prompt, its messages' content)."""
    if request.kind is Kind.CHAT:
        return [sum(text_bytes(t) for t in _content_texts(request.body.get("messages", ())))]
    return [text_bytes(p) for p in request.prompts if isinstance(p, str)]


@dataclass(frozen=True)
class PromptLimit:
    """What a prompt of one tenant may hold: its `maxPromptTokens`, the model's context."""

    tenant_id: str
    max_prompt_tokens: int | None
    max_model_len: int | None

    def error(self, request: ParsedRequest, longest: int | None) -> ApiError | None:
        """PROMPT_TOO_LONG when a prompt's size alone proves it too long, else None."""
        if longest is None:
            return None
        largest = max(prompt_bytes(request), default=0)
        floor = -(-largest // longest)
        head = (f"the prompt has at least {floor} tokens ({largest} bytes, at most "
                f"{longest} bytes per token)")
        if self.max_prompt_tokens is not None and floor > self.max_prompt_tokens:
            return ApiError(400, errors.PROMPT_TOO_LONG,
                            f"{head}; tenant {self.tenant_id!r} may send at most "
                            f"{self.max_prompt_tokens}. Shorten the prompt.",
                            param=request.prompt_param)
        if self.max_model_len is not None and floor >= self.max_model_len:
            return ApiError(400, errors.PROMPT_TOO_LONG,
                            f"{head}; the model's context is {self.max_model_len} tokens, "
                            "including the completion. Shorten the prompt.",
                            param=request.prompt_param)
        return None
