"""What a long prompt, or a retried one, costs the sidecar.

Against the recording stub engine, with the tiny model's real tokenizer: its calls are
what `harness.counter.counts` records (chat prompts too: they go to /tokenize).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.gateway.errors import ApiError

from .conftest import Harness, StubFactory
from .helpers import WAIT, Keys, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

WORDS = "tenant quota cache block lease premium standard free engine 17 2048. "


def _post(harness: Harness, token: str, body: dict[str, Any], route: str = "completions",
          timeout: float = 60) -> httpx.Response:
    return http_post(f"{harness.url}/v1/{route}", json=body, timeout=timeout,
                     headers={"Authorization": f"Bearer {token}"})


def _text(size: int) -> str:
    return (WORDS * (size // len(WORDS) + 1))[:size]


def _varied_text(size: int) -> str:
    """Words and numbers in a seeded random order: few repeats, so the tokenizer's
    per-word cache does not help (the tiny tokenizer needs ~1 us per byte of it)."""
    rng = random.Random(size)
    words = WORDS.split()
    text = " ".join(f"{rng.choice(words)}{rng.randrange(100_000)}" for _ in range(size // 8))
    return text[:size]


@pytest.mark.parametrize("size", [100_000, 5_000_000])  # parsed inline / in a worker
def test_a_prompt_too_long_by_its_size_alone_is_never_tokenized(
    stub_sidecar: StubFactory, keys: Keys, size: int
) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("big", max_blocks_per_engine=1_000_000,
                                     max_prompt_tokens=1000)))
    reply = _post(harness, keys.hs("big"), {"model": "tiny", "prompt": _text(size)})
    assert reply.status_code == 400, reply.text
    assert harness.counter.counts == [] and stub.received == []
    error = reply.json()["error"]
    assert error["code"] == "PROMPT_TOO_LONG" and error["param"] == "prompt"
    longest = harness.counter.longest_token_bytes
    assert f"at least {math.ceil(size / longest)} tokens" in error["message"]
    assert "may send at most 1000" in error["message"]
    # A chat request's cap is maxPromptTokens x 64 bytes: 100 kB of content passes it
    # and is refused by its size, without a /tokenize round trip.
    chat = _post(harness, keys.hs("big"), {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": _text(100_000)}]}]},
        route="chat/completions")
    assert chat.status_code == 400 and "at least" in chat.json()["error"]["message"]
    assert harness.counter.counts == []
    # Within the bounds, the same tenant is served (the floor only refuses for sure).
    fits = _post(harness, keys.hs("big"), {"model": "tiny", "prompt": _text(900 * 4),
                                            "max_tokens": 1})
    assert fits.status_code == 200, fits.text
    assert len(harness.counter.counts) == 1


def test_the_models_context_bounds_a_prompt_by_its_size(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _stub = stub_sidecar()
    harness.apply(make_policy(tenant("big", max_blocks_per_engine=1_000_000)))  # no maxPromptTokens
    reply = _post(harness, keys.hs("big"), {"model": "tiny", "prompt": _text(200_000)})
    assert reply.status_code == 400
    assert "the model's context is 2048 tokens" in reply.json()["error"]["message"]
    assert harness.counter.counts == []


WORDS_AND_ODDITIES = st.lists(
    st.sampled_from([*WORDS.split(), " ", "\n", " " * 16, "\t\t", "é", "日本語", "🙂",
                     "<|user|>", "<s>", "2048.", "x" * 40]),
    min_size=1, max_size=200).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=st.one_of(st.text(min_size=1, max_size=300), WORDS_AND_ODDITIES))
def test_the_size_floor_never_exceeds_the_real_token_count(
    tiny_tokenizer: Any, text: str
) -> None:
    """The floor, ceil(bytes / longest token), for any text: at most what the tiny
    model's tokenizer makes of it (so it refuses only prompts that are too long)."""
    from engine_sidecar.gateway.counting.prompt_bounds import longest_token_bytes, text_bytes

    backend = tiny_tokenizer.backend_tokenizer
    longest = longest_token_bytes(backend)
    assert longest is not None
    for special in (True, False):
        ids = backend.encode(text, add_special_tokens=special).ids
        assert math.ceil(text_bytes(text) / longest) <= len(ids), (text, ids)


def test_a_long_prompt_being_tokenized_does_not_hold_up_another_tenant(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """A 1.5 MB completion prompt within every bound (the engine's context is 10M
    tokens, no maxPromptTokens) takes the tiny tokenizer most of a second (the faster
    worker encode made 500 kB too short a window: one 130 ms stall of a loaded machine
    failed the margin below). Another tenant sends short requests one after another
    until it is answered: the longest time it waits for an answer is a fraction of the
    long request's time.

    The clients run in this process, beside the sidecar: a tokenizer holding the GIL
    froze them too, so the gap is measured between answers (wherever a client was
    frozen, the next answer came that much later). With tokenizing on the event loop's
    thread, the gap was most of the long request's time; the margin of 4 leaves room
    for a slow machine."""
    harness, _stub = stub_sidecar(StubEngine(max_model_len=10_000_000))
    wait_for(lambda: harness.gateway.monitor.max_model_len == 10_000_000, WAIT, "model len")
    harness.apply(make_policy(tenant("big", max_blocks_per_engine=1_000_000), tenant("acme")))
    long_body = httpx.Request("POST", harness.url + "/v1/completions", json={
        "model": "tiny", "prompt": _varied_text(1_500_000), "max_tokens": 1},
        headers={"Authorization": f"Bearer {keys.hs('big')}"})
    head = ["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{harness.server.port}",
            *(f"{k}: {v}" for k, v in long_body.headers.items() if k.lower() != "host"),
            "Connection: close", "", ""]
    done: dict[str, float] = {}

    def send_long() -> None:
        with socket.create_connection(("127.0.0.1", harness.server.port)) as sock:
            done["sent"] = time.monotonic()
            sock.sendall("\r\n".join(head).encode() + long_body.read())
            done["body_sent"] = time.monotonic()
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            done["answered"] = time.monotonic()

    thread = threading.Thread(target=send_long, daemon=True)
    thread.start()
    wait_for(lambda: "body_sent" in done, 30, "the long body was not taken")
    answers = [done["body_sent"]]
    with httpx.Client(headers={"Authorization": f"Bearer {keys.hs('acme')}"}) as client:
        while "answered" not in done and thread.is_alive():
            short = client.post(harness.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "tenant quota", "max_tokens": 1})
            answers.append(time.monotonic())
            assert short.status_code == 200
    thread.join(120)
    long_took = done["answered"] - done["sent"]
    longest_gap = max(b - a for a, b in itertools.pairwise(answers))
    assert len(answers) > 2 and longest_gap < long_took / 4, (longest_gap, long_took)


def test_a_full_tokenizer_pool_refuses_clearly_instead_of_piling_up(
    tiny_tokenizer: Any,
) -> None:
    """One worker takes two jobs; one more request may wait; the next is refused at once
    with 503 TOKENIZER_BUSY and Retry-After. The waiting one is served afterwards."""
    from engine_sidecar.gateway.counting.token_pool import TokenizerPool, encode

    backend = tiny_tokenizer.backend_tokenizer
    pool = TokenizerPool.for_tokenizer(backend, workers=1, max_waiting=1, retry_after=2)
    text = _text(50_000)

    async def four() -> list[Any]:
        jobs = [pool.run(encode, [text], True) for _ in range(4)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = asyncio.run(four())
    finally:
        pool.close()
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(refused) == 1 and results[3] is refused[0]
    assert refused[0].status == 503 and refused[0].code == "TOKENIZER_BUSY"
    assert refused[0].retry_after == 2 and "1 requests already wait" in refused[0].message
    expected = backend.encode(text, add_special_tokens=True).ids
    assert all(list(r[0]) == expected for r in results[:3])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_refused_request_retried_is_not_tokenized_again(
    stub_sidecar: StubFactory, keys: Keys, route: str
) -> None:
    """The tenant's one slot is held; the same request refused twice with 429 (no
    queueing), then admitted: the tokenizer ran once, for the first."""
    harness, stub = stub_sidecar(StubEngine(chunks=3, hold=threading.Event()))
    harness.apply(make_policy(tenant("acme", max_concurrent_requests=1,
                                     max_queue_seconds=0)))
    token = keys.hs("acme")
    if route == "completions":  # long enough for the worker pool
        body: dict[str, Any] = {"model": "tiny", "prompt": _text(5_000), "max_tokens": 2}
    else:
        body = {"model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": _text(5_000)}]}
    holder = threading.Thread(target=_post, args=(harness, token, {**body, "stream": True}),
                              kwargs={"route": route}, daemon=True)
    holder.start()
    wait_for(lambda: stub.active == 1, WAIT, "the first request never reached the engine")
    for _ in range(2):
        refused = _post(harness, token, {**body, "max_tokens": 3}, route)
        assert refused.status_code == 429, refused.text
    stub.release()
    holder.join(30)
    admitted = _post(harness, token, body, route)
    assert admitted.status_code == 200
    assert len(harness.counter.counts) == 1
    assert harness.gateway.prompts.cache.hits == 3


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(texts=st.lists(st.one_of(st.text(min_size=1, max_size=300), WORDS_AND_ODDITIES),
                      min_size=1, max_size=8))
def test_the_worker_pool_counts_exactly_what_the_tokenizer_counts(
    tiny_tokenizer: Any, tokenizer_pool: Any, texts: list[str]
) -> None:
    """The workers' ids (`encode_batch_fast`, no offsets tracked) are the
    tokenizer's own `encode` ids, special tokens in the text and added or not: a count
    lower than the engine's would be a quota escape."""
    from engine_sidecar.gateway.counting.token_pool import encode

    backend = tiny_tokenizer.backend_tokenizer
    for special in (True, False):
        counted = asyncio.run(tokenizer_pool.run(encode, texts, special))
        assert [list(ids) for ids in counted] == [
            backend.encode(text, add_special_tokens=special).ids for text in texts]
