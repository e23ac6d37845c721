"""The official `openai` SDK against the sidecar, the real vLLM CPU engine and the plugin,
as a new user would call it (issue 46): a request that can never fit is one 400 and no
retry; fields the SDK sends that vLLM accepts pass; `response.model` is the name asked
for; a 429 carries the request id the SDK reports, and the SDK's retry after it comes
no earlier than the request holding the tenant's capacity has given it back.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import SERVED_MODEL_NAME

from .conftest import Harness
from .helpers import FULL_RESERVATION, Keys, make_policy, tenant
from .test_engine_contract import _held_stream

pytestmark = pytest.mark.engine

MESSAGES: Any = [{"role": "user", "content": "tenant quota"}]


class _Sent:
    """Every request the SDK puts on the wire (its retries included), and when."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.times: list[float] = []

    def __call__(self, request: httpx.Request) -> None:
        self.paths.append(request.url.path)
        self.times.append(time.monotonic())


def _client(harness: Harness, keys: Keys, sent: _Sent | None = None,
            max_retries: int = 2) -> openai.OpenAI:
    hooks = {"request": [sent]} if sent is not None else {}
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                         max_retries=max_retries, timeout=60,
                         http_client=httpx.Client(event_hooks=hooks))


def test_a_request_that_can_never_fit_is_one_400_and_no_retry(
    sidecar: Harness, keys: Keys,
) -> None:
    # Issue 46's numbers: 640 blocks, watermark 0.15, no guarantee, maxBlocks 600:
    # n=10 x (prompt + 1900) tokens is 600 blocks of 32, and a borrower gets at most 544.
    sidecar.apply(make_policy(
        tenant("acme", max_tokens=1900, max_blocks_per_engine=600, max_queue_seconds=30),
        capacity_blocks=640, watermark=0.15, reservation=FULL_RESERVATION))
    sent = _Sent()
    with pytest.raises(openai.BadRequestError) as never:
        _client(sidecar, keys, sent).chat.completions.create(
            model=SERVED_MODEL_NAME, messages=MESSAGES, n=10, max_tokens=1900)
    assert sent.paths == ["/v1/chat/completions"]  # the SDK did not retry
    assert never.value.code == "REQUEST_EXCEEDS_ENGINE_CAPACITY"
    assert "600 new KV blocks" in never.value.message
    assert "544 of the engine's 640 blocks" in never.value.message
    assert never.value.request_id
    assert sidecar.wait_ledger_empty()


def test_fields_the_sdk_sends_pass_and_the_model_is_the_name_asked_for(
    sidecar: Harness, keys: Keys,
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=16)))
    client = _client(sidecar, keys, max_retries=0)
    chat = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=MESSAGES, max_tokens=2, store=False,
        metadata={"k": "v"}, service_tier="auto", prompt_cache_key="k",
        safety_identifier="s", verbosity="low",
        extra_body={"functions": [{"name": "f", "parameters": {"type": "object"}}]})
    streamed = list(client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=MESSAGES, max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    completion = client.completions.create(model=SERVED_MODEL_NAME, prompt="tenant quota",
                                           max_tokens=2, best_of=1)
    response = client.responses.create(model=SERVED_MODEL_NAME, input="tenant quota",
                                       max_output_tokens=2, safety_identifier="s")
    response_events = list(client.responses.create(
        model=SERVED_MODEL_NAME, input="tenant quota", max_output_tokens=2, stream=True,
        stream_options={"include_obfuscation": False}))
    assert chat.model == completion.model == response.model == SERVED_MODEL_NAME
    assert {chunk.model for chunk in streamed} == {SERVED_MODEL_NAME}
    assert streamed[-1].usage is not None
    assert response_events[-1].type == "response.completed"
    assert sidecar.wait_ledger_empty()


def test_a_429_carries_the_request_id_the_sdk_reports(
    sidecar: Harness, keys: Keys,
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=2000, max_concurrent_requests=1,
                                     max_queue_seconds=0)))
    client = _client(sidecar, keys, max_retries=0)
    with _held_stream(sidecar, keys.hs("acme"), {"max_tokens": 2000}), pytest.raises(
            openai.RateLimitError) as busy:
        client.chat.completions.create(model=SERVED_MODEL_NAME, messages=MESSAGES,
                                       max_tokens=2, extra_headers={"x-request-id": "r-429"})
    assert busy.value.code == "TENANT_CONCURRENCY_EXHAUSTED"
    assert busy.value.request_id == "r-429"
    assert sidecar.wait_ledger_empty(30)


def test_the_sdks_retry_after_a_429_comes_once_the_holder_has_freed_the_slot(
    sidecar: Harness, keys: Keys,
) -> None:
    """One request at a time, no queueing: a 429 while a 1000-token stream holds the slot.
    Its Retry-After (retry-after-ms, which the SDK reads first) is when the stream will
    have decoded its max_tokens at its rate so far; the SDK sleeps that long, so its
    retry reaches the sidecar after the slot is free, and is admitted. The SDK's client
    is built and its resources loaded before the holder starts: its first try then
    follows the holder's 20th event within milliseconds, against the seconds the
    remaining 980 tokens take."""
    sidecar.apply(make_policy(tenant("acme", max_tokens=1000, max_concurrent_requests=1,
                                     max_queue_seconds=0)))
    sent = _Sent()
    completions = _client(sidecar, keys, sent, max_retries=1).completions.with_raw_response
    started = threading.Event()

    def hold() -> None:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", sidecar.url + "/v1/completions",
                headers={"authorization": f"Bearer {keys.hs('acme')}"},
                json={"model": SERVED_MODEL_NAME, "prompt": "tenant quota", "stream": True,
                      "max_tokens": 1000, "ignore_eos": True}) as response:
            for index, _line in enumerate(response.iter_lines()):
                if index == 20:  # decoding: its rate is known
                    started.set()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert started.wait(120)
    answered = completions.create(model=SERVED_MODEL_NAME, prompt="tenant quota", max_tokens=2)
    holder.join(120)
    # Refused once, then retried and admitted: with one slot and no queueing, a retry
    # sent before the holder's slot was free would have been refused again, and the
    # SDK (one retry) would have raised.
    assert answered.http_response.status_code == 200
    assert len(sent.times) == 2
    assert sidecar.wait_ledger_empty()
