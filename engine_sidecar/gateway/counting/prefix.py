"""Fingerprints of a prompt's full KV blocks, so admission counts a shared prefix once.

vLLM's prefix cache keeps one copy of every full block of tokens that several
requests of a tenant share (a system prompt, retrieved documents, earlier turns), so
the ledger counts a tenant's blocks the same way: by a chained hash of each full block
of prompt tokens, so equal fingerprints mean equal prefixes up to that block (as vLLM's
own block hashes do). The hash is Python's, of an integer and the block's token ids as
bytes (`array('I')`): stable within a process, which is all the ledger needs, and
cheaper than hashing a tuple of ints per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence


def block_fingerprints(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One fingerprint per full block of `token_ids` (the partial tail has none)."""
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else (
        array("I", token_ids))
    data = memoryview(ids).cast("B")
    width = block_size * ids.itemsize
    fingerprints = []
    parent = 0
    for end in range(width, len(data) + 1, width):
        parent = hash((parent, data[end - width:end].tobytes()))
        fingerprints.append(parent)
    return tuple(fingerprints)


def prompt_fingerprints(prompts: Iterable[Sequence[int]], block_size: int) -> tuple[int, ...]:
    """The distinct full-block fingerprints of every prompt of a request."""
    seen: dict[int, None] = {}
    for prompt in prompts:
        seen.update(dict.fromkeys(block_fingerprints(prompt, block_size)))
    return tuple(seen)
