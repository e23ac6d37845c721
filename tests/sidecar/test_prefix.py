"""Block fingerprints (`prefix`): equal prefixes, equal fingerprints; any other token, or
another block size, a different chain from that block on."""

from __future__ import annotations

from array import array

from engine_sidecar.gateway.counting.prefix import block_fingerprints, prompt_fingerprints


def test_fingerprints_follow_the_prefix_block_by_block() -> None:
    prompt = list(range(1000, 1100))  # 3 full blocks of 32 and a tail of 4
    prints = block_fingerprints(prompt, 32)
    assert len(prints) == 3 and len(set(prints)) == 3
    assert block_fingerprints(array("I", prompt), 32) == prints  # cached ids: arrays
    assert block_fingerprints((*prompt[:96], 7), 32) == prints  # the tail: none
    changed = [*prompt[:40], 5, *prompt[41:]]  # a token of the second block
    assert block_fingerprints(changed, 32)[0] == prints[0]
    assert block_fingerprints(changed, 32)[1:] != prints[1:]
    assert block_fingerprints(changed, 32)[2] != prints[2]  # chained: later blocks differ
    same_block_elsewhere = [*prompt[32:64], *prompt[:32]]  # block order matters
    assert set(block_fingerprints(same_block_elsewhere, 32)).isdisjoint(prints)
    assert block_fingerprints(prompt, 16)[1] not in prints  # another block size
    assert block_fingerprints(prompt[:31], 32) == ()


def test_a_requests_prompts_share_their_common_blocks_once() -> None:
    system = list(range(64))
    first, second = [*system, *range(500, 532)], [*system, *range(600, 632)]
    prints = prompt_fingerprints([first, second], 32)
    assert len(prints) == 4  # two shared blocks, one of each prompt's own
    assert prompt_fingerprints([first, first], 32) == block_fingerprints(first, 32)
