"""Fingerprints of a prompt's full KV blocks, so admission counts a shared prefix once.

vLLM's prefix cache keeps one copy of every full block of tokens that several
requests of a tenant share (a system prompt, retrieved documents, earlier turns), so
the blocks a tenant holds are distinct blocks, and the ledger counts them the same
way: by a chained hash of each full block of prompt tokens, so equal fingerprints
mean equal prefixes up to that block (as vLLM's own block hashes do). The hash is
Python's, of integers and tuples of integers: stable within a process, which is all
the ledger needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def block_fingerprints(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One fingerprint per full block of `token_ids` (the partial tail has none)."""
    fingerprints = []
    parent = 0
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash((parent, tuple(token_ids[end - block_size:end])))
        fingerprints.append(parent)
    return tuple(fingerprints)


def prompt_fingerprints(prompts: Iterable[Sequence[int]], block_size: int) -> tuple[int, ...]:
    """The distinct full-block fingerprints of every prompt of a request."""
    seen: dict[int, None] = {}
    for prompt in prompts:
        seen.update(dict.fromkeys(block_fingerprints(prompt, block_size)))
    return tuple(seen)
