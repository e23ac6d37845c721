"""The sidecar's prompt count is what the engine processes.

Property, against the real engine: for every request shape the sidecar forwards (every
message role and field, text, refusal and thinking parts, tools, template arguments,
generation-prompt modes, completion prompts of every form), the count the sidecar
admitted the request with equals the engine's `usage.prompt_tokens`. And the issue's
case: a free tenant whose refusal/thinking parts carry ~1,900 tokens is refused for its
quota, instead of being admitted with 3 blocks while the engine holds 60.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Harness
from .helpers import Keys, http_post, make_policy, tenant
from .request_shapes import chat_bodies, completion_bodies, create

pytestmark = pytest.mark.engine

PHRASE = "tenant quota cache block lease premium "


def _client(harness: Harness, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=token, max_retries=0)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=st.one_of(chat_bodies(), chat_bodies(long=True), completion_bodies()))
def test_the_sidecar_counts_what_the_engine_processes(
    sidecar: Harness, keys: Keys, body: dict[str, Any]
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=4)))
    sidecar.gateway.prompts.cache.clear()  # each example counted afresh, even a repeat
    with _client(sidecar, keys.hs("acme")) as client:
        result = create(client, {**body, "max_tokens": 1})
    counted = sidecar.counter.counts[-1]
    assert sum(counted) == result.usage.prompt_tokens, (json.dumps(body)[:2000], counted)


async def test_hidden_parts_count_against_the_tenant_quota(
    sidecar: Harness, engine: Any, keys: Keys
) -> None:
    """The issue's free tenant: maxBlocks 40, four parallel requests whose refusal and
    thinking parts carry ~1,900 tokens. Each is refused (by the sidecar, before the
    engine sees it) as larger than the tenant's whole quota, counted as the engine
    counts its prompt."""
    sidecar.apply(make_policy(tenant("issue-13", tier="free", priority=2, max_blocks_per_engine=40,
                                     max_tokens=8, max_queue_seconds=0)))
    hidden = PHRASE * 316
    rendered = http_post(engine.url + "/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": hidden}]}).json()["count"]
    async with openai.AsyncOpenAI(base_url=sidecar.url + "/v1", api_key=keys.hs("issue-13"),
                                  max_retries=0) as client:

        async def one(kind: str) -> openai.APIStatusError | None:
            try:
                await client.chat.completions.create(
                    model="tiny", max_tokens=8,
                    messages=[{"role": "user", "content": [
                        {"type": kind, kind: hidden}]}])
            except openai.APIStatusError as error:
                return error
            return None

        errors = await asyncio.gather(*(one(k) for k in ("refusal", "thinking") * 2))

    assert rendered > 1800
    assert all(isinstance(e, openai.BadRequestError) for e in errors), errors
    assert {e.code for e in errors if e is not None} == {"REQUEST_EXCEEDS_TENANT_QUOTA"}
    needs = math.ceil((rendered + 8) / 32)
    assert all(f"needs {needs} KV blocks" in str(e) for e in errors), errors[0]
    # Counted once: the three others, the same prompt at the same moment, share it.
    assert sidecar.counter.counts[-1] == (rendered,)
    assert sidecar.ledger_is_empty()
