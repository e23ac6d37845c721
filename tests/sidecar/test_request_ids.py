"""`x-request-id` on every answer, the sidecar's own refusals included (issue 46): the
client's when it sent one, a new one otherwise; the engine gets the same id, and so do
the sidecar's log lines for the request.

Against the recording stub engine; `exc.request_id` on a 429 from the real engine is in
test_openai_sdk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

from engine_sidecar.gateway.request_id import LOG_FILTER

from .conftest import StubFactory
from .helpers import Keys, make_policy, tenant

COMPLETION = {"prompt": "tenant quota cache", "max_tokens": 2}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(LOG_FILTER)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    gateway_log = logging.getLogger("engine_sidecar.gateway")
    level = gateway_log.level
    gateway_log.addHandler(handler)
    gateway_log.setLevel(logging.DEBUG)
    yield handler
    gateway_log.removeHandler(handler)
    gateway_log.setLevel(level)


def test_the_clients_id_comes_back_and_reaches_the_engine(
    stub_sidecar: StubFactory, keys: Keys,
) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_tokens=16)))
    auth = {"authorization": f"Bearer {keys.hs('acme')}"}
    sent = httpx.post(harness.url + "/v1/completions", json=COMPLETION,
                      headers={**auth, "x-request-id": "client-chose-this"})
    fresh = httpx.post(harness.url + "/v1/completions", json=COMPLETION, headers=auth)
    assert (sent.status_code, fresh.status_code) == (200, 200)
    assert sent.headers.get_list("x-request-id") == ["client-chose-this"]
    new_id = fresh.headers["x-request-id"]
    assert len(new_id) == 32 and new_id != "client-chose-this"
    assert [h["x-request-id"] for h in stub.received_headers] == ["client-chose-this", new_id]


def test_the_sidecars_own_refusals_carry_an_id_the_sdk_reads(
    stub_sidecar: StubFactory, keys: Keys, records: _Records,
) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_tokens=16)))
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=keys.hs("acme"),
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="tenant quota", max_tokens=2,
                                  extra_body={"use_beam_search": True},
                                  extra_headers={"x-request-id": "mine-1"})
    with pytest.raises(openai.AuthenticationError) as unknown:
        openai.OpenAI(base_url=harness.url + "/v1", api_key="not-a-token",
                      max_retries=0).completions.create(model="tiny", prompt="x")
    assert bad.value.request_id == "mine-1"
    assert unknown.value.request_id and len(unknown.value.request_id) == 32
    elsewhere = httpx.get(harness.url + "/v1/no-such-route")
    assert elsewhere.status_code == 404 and elsewhere.headers["x-request-id"]
    assert stub.received == []
    # The sidecar's log line for each refusal names the request.
    refused = {r.request_id: r.getMessage() for r in records.records  # type: ignore[attr-defined]
               if r.getMessage().startswith("refused")}
    assert "INVALID_REQUEST" in refused["mine-1"]
    assert "UNAUTHENTICATED" in refused[unknown.value.request_id]


def test_an_unusable_client_id_is_replaced(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_tokens=16)))
    response = httpx.post(harness.url + "/v1/completions", json=COMPLETION, headers={
        "authorization": f"Bearer {keys.hs('acme')}", "x-request-id": "x" * 500})
    assert response.status_code == 200
    assert len(response.headers["x-request-id"]) == 32
    assert stub.received_headers[0]["x-request-id"] == response.headers["x-request-id"]
