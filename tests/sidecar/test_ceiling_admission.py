"""Admission on a prompt's token ceiling, over HTTP against a stub engine.

A request that fits at its ceiling is admitted without being counted first; its exact
count, taken afterwards, leaves its tenant's reservation where counting first would
have put it. A request that only fits at its exact count is counted first and admitted
on it: a tenant is never let past its maxBlocks by a bound.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_sidecar.contract.names import RESERVED_BLOCKS_ARG, RESERVED_OUTPUT_ARG
from engine_sidecar.gateway.app import GatewayConfig
from engine_sidecar.gateway.counting.prompt_count import PromptCounting
from engine_sidecar.gateway.counting.token_pool import TokenizerPool
from engine_sidecar.gateway.counting.tokens import EngineTokenCounter, HfTokenCounter
from engine_sidecar.gateway.intake.openai_request import Kind, parse
from engine_sidecar.plugin.rules.identity import identity_from_extra_args, outgrew
from kvquota_lab.perf.sidecar import admission_counts

from .conftest import Harness, start_harness
from .helpers import WAIT, Keys, ServerThread, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

PROMPT = "Grüße 日本語 🙂 def f(x): return {'quota': x}  " * 12
CHAT = [{"role": "system", "content": "You count KV blocks. " * 20},
        {"role": "user", "content": [{"type": "text", "text": PROMPT},
                                     {"type": "text", "text": "[image: cat.png]"}]}]


def _harness(keys: Keys, tokenizer: Any, name: str, pool: TokenizerPool | None,
             tmp_path: Path) -> Iterator[tuple[Harness, StubEngine, HfTokenCounter]]:
    stub = StubEngine(chunks=2, hold=threading.Event())
    stub_server = ServerThread(stub).start()
    counters: list[HfTokenCounter] = []

    def counter(gateway: Any) -> HfTokenCounter:
        counters.append(HfTokenCounter(
            tokenizer, name, EngineTokenCounter(gateway.upstream, None), pool,
            verify_chats=0))
        return counters[0]

    harness = start_harness(tmp_path, GatewayConfig(
        upstream=stub_server.url, secrets_dir=keys.dir,
        plugin_policy_path=tmp_path / "plugin-policy.json", engine_probe_interval=0.2),
        counter)
    try:
        wait_for(lambda: harness.gateway.monitor.up, WAIT, "stub engine not seen up")
        yield harness, stub, counters[0]
    finally:
        for server in (harness.admin, harness.server, stub_server):
            server.stop()


@pytest.fixture
def bounded(keys: Keys, tiny_model: Path, tiny_tokenizer: Any,
            tokenizer_pool: TokenizerPool, tmp_path: Path
            ) -> Iterator[tuple[Harness, StubEngine, HfTokenCounter]]:
    """A sidecar counting with the tiny model's tokenizer (its ceiling on), in front of a
    stub engine whose streams wait for `stub.release()`."""
    yield from _harness(keys, tiny_tokenizer, str(tiny_model), tokenizer_pool, tmp_path)


@pytest.fixture
def unbounded(keys: Keys, tiny_model: Path, tiny_tokenizer: Any, tmp_path: Path
              ) -> Iterator[tuple[Harness, StubEngine, HfTokenCounter]]:
    """The same with a SentencePiece-style tokenizer: the tiny vocabulary behind a
    Metaspace pre-tokenizer ('\u2581' before each word: tokens no byte of the prompt pays
    for), which has no ceiling (`prompt_bounds.token_ceiling`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "always", "split": True}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    tokenizer.chat_template = tiny_tokenizer.chat_template
    yield from _harness(keys, tokenizer, "metaspace", None, tmp_path)


def _send(harness: Harness, token: str, body: dict[str, Any]) -> tuple[threading.Thread,
                                                                        list[httpx.Response]]:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(http_post(
        harness.url + route, json={**body, "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {token}"}, timeout=30)), daemon=True)
    thread.start()
    return thread, out


def _held(harness: Harness, stub: StubEngine, token: str, body: dict[str, Any]) -> int:
    """The tenant's reserved blocks while one request of `body` streams, once its count
    (if taken after admission) is in; the request then finishes."""
    stub.hold = threading.Event()
    thread, out = _send(harness, token, body)
    wait_for(lambda: stub.active == 1, WAIT, "the request never reached the engine")
    wait_for(lambda: not harness.gateway.admitter.ceiling.recounts, WAIT, "count never taken")
    reserved = harness.gateway.ledger.reserved_blocks("acme")
    stub.release()
    thread.join(30)
    assert out and out[0].status_code == 200
    harness.wait_ledger_empty()
    harness.gateway.prompts.cache.clear()
    return reserved


def _admissions(harness: Harness) -> tuple[float, float]:
    """(admitted on a ceiling, admitted) as the admin port's /metrics shows them, read
    the way the latency bench reads them for its rows."""
    return asyncio.run(admission_counts(harness.admin_url))


@pytest.mark.parametrize("body", [{"prompt": PROMPT}, {"messages": CHAT}],
                         ids=["completion", "chat"])
def test_admitted_on_its_ceiling_then_charged_its_count(
    bounded: tuple[Harness, StubEngine, HfTokenCounter], keys: Keys, body: dict[str, Any]
) -> None:
    harness, stub, counter = bounded
    harness.apply(make_policy(tenant("acme")))
    token = keys.hs("acme")
    on_ceiling = _held(harness, stub, token, body)
    assert harness.gateway.admitter.ceiling.admissions == 1
    assert _admissions(harness) == (1.0, 1.0)
    if "messages" in body:  # counted by the engine, not rendered and encoded here
        assert counter.chats_sent == 1 and counter.chats_verified == 0
    ceiling, counter.ceiling = counter.ceiling, None  # the old path: count, then decide
    counted_first = _held(harness, stub, token, body)
    assert harness.gateway.admitter.ceiling.admissions == 1
    assert _admissions(harness) == (1.0, 2.0)  # the metric tells the two apart
    assert on_ceiling == counted_first > 0
    assert ceiling is not None


def test_a_request_that_fits_only_at_its_count_is_counted_first(
    bounded: tuple[Harness, StubEngine, HfTokenCounter], keys: Keys, tiny_tokenizer: Any
) -> None:
    """maxBlocks below what the ceiling needs, at or above what the count needs: the
    request is admitted, on its count, and its tenant never holds more than maxBlocks."""
    harness, stub, counter = bounded
    exact = len(tiny_tokenizer.backend_tokenizer.encode(PROMPT).ids)
    assert counter.ceiling is not None
    ceiling = counter.ceiling.of(PROMPT, True)
    block = make_policy(tenant("acme")).block_size
    needs = math.ceil((exact + 4) / block)
    assert math.ceil((ceiling + 4) / block) > needs  # the bound alone would not fit
    harness.apply(make_policy(tenant("acme", max_blocks_per_engine=needs, max_queue_seconds=0)))
    reserved = _held(harness, stub, keys.hs("acme"), {"prompt": PROMPT})
    assert harness.gateway.admitter.ceiling.admissions == 0
    assert 0 < reserved <= needs


def test_a_count_above_its_ceiling_turns_chat_ceilings_off(
    bounded: tuple[Harness, StubEngine, HfTokenCounter], keys: Keys
) -> None:
    """An engine that renders a chat longer than the sidecar's rendering bounds it (here:
    a stub counting each word 8 times) is caught at the first count: its tenant's
    reservation grows to that count, and later chats are counted before admission."""
    harness, stub, counter = bounded
    harness.apply(make_policy(tenant("acme")))
    stub.tokenize_repeat = 8
    token = keys.hs("acme")
    first = _held(harness, stub, token, {"messages": CHAT})
    assert harness.gateway.admitter.ceiling.admissions == 1
    assert counter.renderer is None
    second = _held(harness, stub, token, {"messages": CHAT})
    assert harness.gateway.admitter.ceiling.admissions == 1  # counted first this time
    assert first == second
    assert counter.ceiling is not None  # completions keep theirs


def test_the_plugin_is_told_the_ceiling_and_judges_at_the_count(
    bounded: tuple[Harness, StubEngine, HfTokenCounter], keys: Keys
) -> None:
    """Until its count is in, a chat admitted on its ceiling holds its tenant's blocks at
    that ceiling (no prefix credited) and the plugin is told the ceiling's blocks per
    sequence, with the output tokens they include; the plugin takes those at the prompt
    it counts, so it judges the request as counting first would have reserved it. Once
    the count is in, the tenant holds what counting first holds."""
    harness, stub, counter = bounded
    harness.apply(make_policy(tenant("acme")))
    block = make_policy(tenant("acme")).block_size
    gate = stub.tokenize_gate = threading.Event()
    stub.hold = threading.Event()
    thread, out = _send(harness, keys.hs("acme"), {"messages": CHAT})
    wait_for(lambda: stub.active == 1, WAIT, "the request never reached the engine")
    at_ceiling = harness.gateway.ledger.reserved_blocks("acme")
    xargs = stub.received[-1]["vllm_xargs"]
    gate.set()
    wait_for(lambda: not harness.gateway.admitter.ceiling.recounts, WAIT, "count never taken")
    counted = harness.gateway.ledger.reserved_blocks("acme")
    stub.release()
    thread.join(30)
    assert out and out[0].status_code == 200
    assert harness.gateway.admitter.ceiling.admissions == 1
    request = parse(Kind.CHAT, json.dumps({"messages": CHAT}).encode())
    ceilings = PromptCounting().ceilings(counter, request)
    assert ceilings is not None
    output = xargs[RESERVED_OUTPUT_ARG]
    assert 0 < output <= 4
    assert xargs[RESERVED_BLOCKS_ARG] == math.ceil((ceilings[0] + output) / block)
    assert at_ceiling > counted > 0

    harness.wait_ledger_empty()
    harness.gateway.prompts.cache.clear()
    counter.renderer = None  # no chat ceiling: counted first
    counted_first = _held(harness, stub, keys.hs("acme"), {"messages": CHAT})
    assert counted_first == counted
    exact = json.dumps(CHAT)  # the stub's count: one token per word of the messages
    prompt = len(exact.split())
    first = stub.received[-1]["vllm_xargs"]
    assert first[RESERVED_BLOCKS_ARG] == math.ceil((prompt + output) / block)
    identity = identity_from_extra_args(xargs)  # the ceiling's, judged by the plugin
    assert not outgrew(identity, first[RESERVED_BLOCKS_ARG], prompt, block)
    assert outgrew(identity, first[RESERVED_BLOCKS_ARG] + 1, prompt, block)


def test_a_tokenizer_without_a_ceiling_counts_before_admitting(
    unbounded: tuple[Harness, StubEngine, HfTokenCounter], keys: Keys
) -> None:
    """No ceiling (SentencePiece's '\u2581'): every request is counted first, as before
    ceilings, and decided on its count: a tenant whose maxBlocks the exact count just
    fits is admitted, and holds no more."""
    harness, stub, counter = unbounded
    assert counter.ceiling is None and counter.renderer is not None
    (ids,) = asyncio.run(counter.tokenize(parse(Kind.COMPLETION,
                                                json.dumps({"prompt": PROMPT}).encode())))
    exact = len(ids)
    block = make_policy(tenant("acme")).block_size
    needs = math.ceil((exact + 4) / block)
    harness.apply(make_policy(tenant("acme", max_blocks_per_engine=needs, max_queue_seconds=0)))
    token = keys.hs("acme")
    assert 0 < _held(harness, stub, token, {"prompt": PROMPT}) <= needs
    assert 0 < _held(harness, stub, token, {"messages": CHAT[1:]}) <= needs
    assert harness.gateway.admitter.ceiling.admissions == 0
    assert counter.chats_sent == 1  # counted by the engine, before it was admitted
