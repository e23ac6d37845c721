"""Properties of the request surface: no request body or header a client can send makes
the sidecar answer 500, and none makes the engine process more than was reserved.

Against a cheap stub engine (200 examples) the first property covers the sidecar alone;
a smaller run against the real engine also shows vLLM accepts whatever the sidecar
forwards (or refuses it with a 4xx, never a 5xx that we would map to 502). The second
runs against the real engine only: its usage is the measure.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Harness, StubFactory
from .helpers import FULL_RESERVATION, Keys, http_get, make_policy, tenant
from .request_shapes import ESCAPES, chat_bodies, completion_bodies, create, long_part

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False), st.text(max_size=40),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
TOKEN_IDS = st.lists(st.integers(-5, 3000), min_size=0, max_size=8)
PROMPTS = st.one_of(
    st.text(max_size=200), st.lists(st.text(max_size=30), max_size=3), TOKEN_IDS,
    st.lists(TOKEN_IDS, max_size=3), JSON,
)
GOOD_COUNTS = st.integers(1, 3000)
COUNTS = st.one_of(GOOD_COUNTS, GOOD_COUNTS, st.integers(-3, 5000),
                   st.integers(-(2**65), 2**65), SCALARS)
CONTENT = st.one_of(
    st.text(max_size=120), st.none(),
    st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)}),
        st.dictionaries(st.sampled_from(["type", "text", "image_url"]), JSON, max_size=3)),
        max_size=3),
    JSON,
)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]),
         "content": CONTENT},
        optional={"name": st.text(max_size=8), "tool_calls": JSON}), max_size=4),
    JSON,
)
EXTRAS = {
    "max_tokens": COUNTS, "max_completion_tokens": COUNTS, "n": COUNTS,
    "stream": SCALARS, "priority": COUNTS, "cache_salt": SCALARS, "vllm_xargs": JSON,
    "user": SCALARS, "temperature": SCALARS, "stream_options": JSON,
    "add_special_tokens": SCALARS, "add_generation_prompt": SCALARS, "tools": JSON,
    "continue_final_message": SCALARS, "prompt_embeds": SCALARS,
}
PLAUSIBLE = {"max_tokens": GOOD_COUNTS, "n": st.integers(1, 3), "stream": st.booleans(),
             "priority": COUNTS, "cache_salt": SCALARS, "vllm_xargs": JSON, "user": SCALARS}
BODIES = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=300)}, optional=PLAUSIBLE),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]),
         "content": st.text(max_size=120)}), min_size=1, max_size=3)}, optional=PLAUSIBLE),
    st.fixed_dictionaries({"prompt": PROMPTS}, optional=EXTRAS),
    st.fixed_dictionaries({"messages": MESSAGES}, optional=EXTRAS),
    JSON,
)
RAW = st.one_of(
    BODIES.map(lambda b: json.dumps(b).encode()),
    BODIES.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=64),
    st.just(b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 1}'),
    st.just(b"[" * 5000 + b"]" * 5000),
)
HEADER_TEXT = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60)


@st.composite
def requests(draw: st.DrawFn, keys: Keys) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    if draw(st.integers(0, 9)) < 8:  # mostly valid callers, so bodies reach admission
        auth = f"Bearer {keys.hs(draw(st.sampled_from(['acme', 'free'])))}"
    else:
        auth = draw(st.one_of(HEADER_TEXT.map(lambda t: f"Bearer {t}".strip()), HEADER_TEXT))
    headers = {"Authorization": auth, "Content-Type": "application/json"}
    if draw(st.booleans()):
        headers["X-Session-Id"] = draw(HEADER_TEXT)
    return path, draw(RAW), headers


def _fuzz_policy() -> Any:
    return make_policy(
        tenant("acme", tier="premium", priority=0, max_tokens=4, max_prompt_tokens=500,
               max_concurrent_requests=8, guaranteed_blocks=20_000),
        tenant("free", tier="free", priority=2, max_tokens=2, max_blocks_per_engine=40,
               prefix_cache_isolation="Shared"),
    )


def _check(harness: Harness, client: httpx.Client,
           request: tuple[str, bytes, dict[str, str]]) -> int:
    path, body, headers = request
    response = client.post(harness.url + path, content=body, headers=headers)
    assert response.status_code < 500 or response.status_code == 503, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert "Traceback" not in response.text
    return response.status_code


@pytest.fixture
def fuzz_stub(stub_sidecar: StubFactory) -> Harness:
    harness, _ = stub_sidecar()
    harness.apply(_fuzz_policy())
    return harness


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_requests_never_500_stub_engine(
    fuzz_stub: Harness, keys: Keys, data: st.DataObject
) -> None:
    with httpx.Client(timeout=30) as client:
        _check(fuzz_stub, client, data.draw(requests(keys)))
    assert fuzz_stub.wait_ledger_empty()


@pytest.mark.engine
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_requests_never_500_real_engine(
    sidecar: Harness, keys: Keys, data: st.DataObject
) -> None:
    sidecar.apply(_fuzz_policy())
    with httpx.Client(timeout=60) as client:
        _check(sidecar, client, data.draw(requests(keys)))


# ------------------------------------------- the engine never holds more than reserved

MEDIA_PART = st.sampled_from([
    {"type": "image_url", "image_url": {"url": "http://example.test/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "tool_reference", "name": "lookup"},
])
SURFACE_EXTRAS = {
    "max_tokens": st.integers(1, 16), "ignore_eos": st.booleans(),
    "request_id": st.just("client-chosen"), "suffix": st.just(" done"),
    "truncate_prompt_tokens": st.integers(1, 8), "best_of": st.integers(1, 3),
    **ESCAPES,
}


@st.composite
def surface_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly valid requests of every shape, some with a field or part that once let the
    engine process more than the sidecar counted."""
    chat = draw(st.booleans())
    body = draw(chat_bodies(long=draw(st.booleans())) if chat else completion_bodies())
    if chat and draw(st.integers(0, 3)) == 0:
        extra = draw(st.one_of(long_part(("refusal", "thinking")), MEDIA_PART))
        body["messages"].append({"role": "user", "content": [extra]})
    extras = draw(st.fixed_dictionaries({}, optional=SURFACE_EXTRAS))
    if draw(st.integers(0, 2)):  # the dangerous ones in a third of the examples
        extras = {k: v for k, v in extras.items() if k in ("max_tokens", "ignore_eos")}
    return {**body, **extras}


def _reserved_blocks(harness: Harness, tier: str) -> float:
    metrics = http_get(harness.admin_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "kvquota_reserved_blocks_total" and sample.labels == {
                    "tier": tier}:
                return sample.value
    return 0.0


@pytest.mark.engine
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=surface_bodies())
def test_the_engine_never_processes_more_than_the_reservation(
    sidecar: Harness, keys: Keys, body: dict[str, Any]
) -> None:
    """For every admitted request, the tokens the engine processed for it (each of its n
    sequences holds the prompt, plus every completion token) fit in the KV blocks the
    sidecar reserved at max_tokens (`Full`; an `Estimated` reservation may be outgrown by
    design, but never by a miscounted prompt); refused ones never reach the engine."""
    free = tenant("free", tier="free", priority=2, max_tokens=16, max_blocks_per_engine=5000)
    policy = sidecar.apply(make_policy(free, reservation=FULL_RESERVATION))
    before = _reserved_blocks(sidecar, "free")
    with openai.OpenAI(base_url=sidecar.url + "/v1", api_key=keys.hs("free"),
                       max_retries=0, timeout=60) as client:
        try:
            usage = create(client, body).usage
        except openai.BadRequestError as refused:
            by_sidecar = isinstance(refused.code, str)  # vLLM's codes are numbers
            event("refused by the sidecar" if by_sidecar else "refused by the engine")
            assert not by_sidecar or _reserved_blocks(sidecar, "free") == before
            return
    reserved_tokens = (_reserved_blocks(sidecar, "free") - before) * policy.block_size
    used = body.get("n", 1) * usage.prompt_tokens + usage.completion_tokens
    event("admitted")
    target(used / reserved_tokens, label="tokens processed / tokens reserved")
    assert used <= reserved_tokens, (json.dumps(body)[:1500], usage, reserved_tokens)
