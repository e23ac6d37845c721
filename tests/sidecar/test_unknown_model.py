"""A model the engine does not serve is OpenAI's 404 (issue 46): string code
`model_not_found`, type `invalid_request_error`, `param` model, and a message naming
the names /v1/models lists, never a server path; refused before it is counted or queued.
"""

from __future__ import annotations

import openai
import pytest

from .conftest import StubFactory
from .helpers import Keys, make_policy, tenant
from .stub_engine import StubEngine


def test_an_unknown_model_is_openais_404_naming_the_served_ones(
    stub_sidecar: StubFactory, keys: Keys,
) -> None:
    # vLLM without --served-model-name serves the path; clients know the pool's name.
    harness, stub = stub_sidecar(StubEngine(model_id="/models/llama-3-8b"))
    harness.apply(make_policy(tenant("acme", max_tokens=16)))
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                           max_retries=0)
    listed = [model.id for model in client.models.list()]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found"
    assert unknown.value.body == {
        "message": "The model 'gpt-4o' does not exist here; this server serves: tiny",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert listed == ["tiny"]
    assert unknown.value.request_id
    assert stub.received == []
    # The listed name and the engine's own both reach the engine.
    client.completions.create(model="tiny", prompt="tenant quota", max_tokens=2)
    client.completions.create(model="/models/llama-3-8b", prompt="tenant quota", max_tokens=2)
    assert [body["model"] for body in stub.received] == ["/models/llama-3-8b"] * 2
    assert harness.wait_ledger_empty()
