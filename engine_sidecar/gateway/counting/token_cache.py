"""Token ids of recent prompts, so a retried request is not tokenized again.

A client refused with 429/503, or one that queued and gave up, sends the same prompt
again; so do clients that repeat a system prompt or a few-shot completion. The key is a
digest of everything that decides the ids: the counter (tokenizer, engine model), the
route, and the prompt material (completion prompts and `add_special_tokens`; for chat,
the /tokenize payload: messages, tools, template arguments). Equal keys have equal ids.

Bounded twice: by entries and by the token ids held (4 bytes each, `array('I')`), the
least recently used going first. Identical prompts counted at the same moment share one
count (the second waits for the first), so a burst of retries tokenizes once.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from engine_sidecar.gateway import json_codec

Counted = tuple[Sequence[int], ...]

MAX_ENTRIES = 4096
MAX_TOKENS = 4_000_000  # 16 MB of ids


def digest(material: bytes, *context: str | None) -> bytes:
    """A key for encoded prompt material (the bytes the counter is sent, or would be)
    under `context` (counter, engine model, route). The context is a JSON array, so it
    ends where the material starts. Keys keep the client's order (a retry sends the same
    body; sorting cost more than the hash)."""
    hasher = hashlib.blake2b(json_codec.dumps(list(context)), digest_size=16)
    hasher.update(material)
    return hasher.digest()


class TokenCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, Counted] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[Counted]] = {}
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    async def get_or_count(self, key: bytes, count: Callable[[], Awaitable[Counted]]
                           ) -> Counted:
        """The cached ids for `key`, else `count()`'s (stored). Errors are not stored."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        pending = self._pending.get(key)
        if pending is not None:
            self.hits += 1
            return await asyncio.shield(pending)
        self.misses += 1
        future: asyncio.Future[Counted] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            counted = tuple(p if isinstance(p, array) else array("I", p) for p in await count())
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning if alone
            else:
                future.cancel()
            raise
        finally:
            del self._pending[key]
        future.set_result(counted)
        self._store(key, counted)
        return counted

    def _store(self, key: bytes, counted: Counted) -> None:
        size = sum(len(p) for p in counted)
        if size > self.max_tokens:
            return
        self._entries[key] = counted
        self.tokens += size
        while len(self._entries) > self.max_entries or self.tokens > self.max_tokens:
            _key, dropped = self._entries.popitem(last=False)
            self.tokens -= sum(len(p) for p in dropped)
