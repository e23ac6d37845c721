"""A prompt's token count bounded by its size, before anything is tokenized.

A token stands for at most `longest` bytes of text (the vocabulary's longest token), so
a prompt of B bytes has at least ceil(B / longest) tokens: one whose floor is over the
tenant's `maxPromptTokens` or the model's context is refused (400 PROMPT_TOO_LONG) at
the cost of measuring string lengths, never tokenized. The floor holds when no token
covers more input bytes than its own spelling (byte-level BPE, SentencePiece pieces; a
normalizer widens the margin); an unknown token that swallows a run of characters
(Unigram without byte fallback, WordPiece, WordLevel) has no bound, so such tokenizers
get no floor. `TokenCeiling` is the other side: the most tokens a prompt can have.
Chat prompts: the floor counts the messages' text, to which a template only adds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.openai_request import Kind, ParsedRequest

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


# ---------------------------------------------------------------- the ceiling

# The most UTF-8 bytes one input byte can become under each normalizer (ASCII stays
# ASCII, one byte, under all of them): NFC/NFD decompose a character into at most three
# times its bytes (Hangul syllables, composition exclusions), NFKC/NFKD into at most 18
# (U+FDFA), lowercasing grows a character by at most half ('İ' -> 'i̇').
NORMALIZER_GROWTH = {"NFC": 3, "NFD": 3, "NFKC": 18, "NFKD": 18, "Lowercase": 3}
# Pre-tokenizers that only split text (no byte is added): a token still covers at least
# one byte of the text they were given.
SPLITTING_PRE_TOKENIZERS = frozenset({
    "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "UnicodeScripts"})


@dataclass(frozen=True)
class TokenCeiling:
    """The most tokens a text can encode to, from its size.

    Every token of a byte-level vocabulary covers at least one byte of the text it was
    given (a byte no merge covers is a token of its own; an added token in the text
    covers its whole spelling), so a text of B bytes encodes to at most B tokens, plus
    what the post-processor adds (`specials`, with add_special_tokens). A normalizer
    that can grow non-ASCII text multiplies those bytes by `growth`."""

    growth: int = 1
    specials: int = 0

    def of(self, text: str, special: bool) -> int:
        added = self.specials if special else 0
        if text.isascii():
            return len(text) + added
        size = len(text.encode("utf-8", "surrogatepass"))
        if self.growth == 1:
            return size + added
        ascii_bytes = sum(1 for c in text if c < "\x80")
        return ascii_bytes + self.growth * (size - ascii_bytes) + added


def _growth(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        growth = 1
        for step in normalizer.get("normalizers", ()):
            factor = _growth(step)
            if factor is None:
                return None
            growth *= factor
        return growth
    return NORMALIZER_GROWTH.get(str(kind))


def _byte_level(pre_tokenizer: dict[str, Any] | None) -> bool | None:
    """True: byte-level (every byte a symbol of its own, no prefix space); False: it
    only splits; None: it adds text (a prefix space, Metaspace's '▁'), which no size
    bound here covers."""
    if pre_tokenizer is None:
        return False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        steps = [_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ())]
        return None if None in steps else any(steps)
    if kind == "ByteLevel":
        return None if pre_tokenizer.get("add_prefix_space") else True
    return False if kind in SPLITTING_PRE_TOKENIZERS else None


def token_ceiling(backend: Any) -> TokenCeiling | None:
    """The ceiling of a `tokenizers.Tokenizer`, or None when this module cannot bound
    its count from the text's size (a model other than BPE; a pre-tokenizer or
    normalizer that adds text, e.g. Metaspace's '▁'): such a tokenizer's prompts are
    counted before they are admitted.

    A BPE token covers at least one symbol: a byte (byte-level), a character, or one
    byte of a character spelled by byte fallback; an unknown token, fused or not, covers
    at least one character. So no token covers less than one byte."""
    import json

    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    growth = _growth(spec.get("normalizer"))
    if byte_level is None or growth is None or model.get("type") != "BPE":
        return None
    return TokenCeiling(growth, backend.num_special_tokens_to_add(False))
