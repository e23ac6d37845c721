"""An engine that renders chat prompts differently is noticed: no ceiling under-counts.

The sidecar bounds chat prompts by its own rendering with the model's template, but
cannot see an engine's `--chat-template` or `--default-chat-template-kwargs`. It renders
its first chat prompts here too and compares them with the engine's count; here the
engine (a stub whose /tokenize answers with its own ids) renders differently, so the
sidecar admits with the engine's count and takes no chat ceiling after that.
"""

from __future__ import annotations

from engine_sidecar.gateway.counting.tokens import HfTokenCounter

from .conftest import StubFactory
from .helpers import Keys, http_post, make_policy, tenant


def _chat(url: str, keys: Keys, text: str) -> None:
    response = http_post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {keys.hs('acme')}"})
    assert response.status_code == 200, response.text


def test_a_differing_engine_rendering_turns_local_counting_off(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_tokens=8)))
    counter = harness.counter.inner
    assert isinstance(counter, HfTokenCounter) and counter.renderer is not None

    _chat(harness.url, keys, "tenant quota cache block lease")
    _chat(harness.url, keys, "premium free engine the sidecar")

    assert counter.renderer is None  # the first difference was enough
    assert counter.chats_verified == 1 and counter.chats_sent == 2
    # Both admitted with the engine's count (the stub's /tokenize: one id per word of
    # the messages' JSON, 8 here), not the local one (a dozen tokens of the template).
    assert harness.counter.counts == [(8,), (8,)]
