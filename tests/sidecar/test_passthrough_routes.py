"""Every route vLLM serves keeps working through the sidecar (the real CPU engine).

Each route is asked of the engine directly and through the sidecar in the same test:
what a client gets through the sidecar is what vLLM answers, except that credentials
are checked first on the routes that cost engine work and the sidecar sets the
tenant's fields (see engine_sidecar/gateway/relay/passthrough.py for which and why).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Harness
from .helpers import Keys, http_post, make_policy, tenant

pytestmark = pytest.mark.engine

MAX_TOKENS = 6  # the tenant's ceiling, far below what the client asks for


@pytest.fixture
def acme(sidecar: Harness, keys: Keys) -> dict[str, str]:
    sidecar.apply(make_policy(tenant("acme", max_tokens=MAX_TOKENS, default_max_tokens=4)))
    return {"Authorization": f"Bearer {keys.hs('acme')}"}


def _both(sidecar: Harness, engine: Any, method: str, path: str, headers: dict[str, str],
          **kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
    direct = httpx.request(method, engine.url + path, timeout=60, **kwargs)
    proxied = httpx.request(method, sidecar.url + path, headers=headers, timeout=60, **kwargs)
    return direct, proxied


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
])
def test_probe_routes_answer_as_vllm_does_without_credentials(
    sidecar: Harness, engine: Any, acme: dict[str, str], method: str, path: str,
) -> None:
    direct, proxied = _both(sidecar, engine, method, path, {})
    assert direct.status_code == 200
    assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)


def test_vllm_metrics_stay_scrapeable_on_the_client_port(
    sidecar: Harness, engine: Any, acme: dict[str, str],
) -> None:
    direct, proxied = _both(sidecar, engine, "GET", "/metrics", {})
    assert proxied.status_code == direct.status_code == 200
    assert proxied.headers["content-type"] == direct.headers["content-type"]

    def families(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}

    # vLLM's own registry, with the engine's vllm:* series the production-stack router
    # and endpoint pickers scrape (its kv-cache usage and queue lengths), is what the
    # client port must serve, plus the sidecar's per-tier picker signals (the queue it
    # holds, the KV it reserved); its kvquota_* families stay on the admin port.
    engine_families = families(direct.text)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc"} <= engine_families
    assert families(proxied.text) == engine_families | {
        "kvquota:num_requests_waiting", "kvquota:kv_cache_usage_perc"}
    assert not any(f.startswith("kvquota_") for f in families(proxied.text))
    signals = {(s.name, s.labels["tier"]) for f in text_string_to_metric_families(
        proxied.text) for s in f.samples if s.name.startswith("kvquota:")}
    assert signals == {(name, tier) for tier in ("premium", "standard", "free", "all")
                       for name in ("kvquota:num_requests_waiting",
                                    "kvquota:kv_cache_usage_perc")}


def test_tokenize_and_detokenize_need_a_tenant_and_match_the_engine(
    sidecar: Harness, engine: Any, acme: dict[str, str],
) -> None:
    body = {"model": str(engine.model), "prompt": "tenant quota cache block"}
    direct, proxied = _both(sidecar, engine, "POST", "/tokenize", acme, json=body)
    assert proxied.status_code == direct.status_code == 200
    tokens = direct.json()["tokens"]
    assert proxied.json()["tokens"] == tokens
    back = {"model": str(engine.model), "tokens": tokens}
    direct, proxied = _both(sidecar, engine, "POST", "/detokenize", acme, json=back)
    assert proxied.status_code == 200 and proxied.json() == direct.json()
    anonymous = http_post(sidecar.url + "/tokenize", json=body, timeout=30)
    assert anonymous.status_code == 401


def test_embeddings_are_forwarded_with_the_engines_own_answer(
    sidecar: Harness, engine: Any, acme: dict[str, str],
) -> None:
    # The tiny model is a generation model: vLLM itself refuses embeddings for it, and
    # that answer (not a sidecar 404) is what a client must see through the sidecar.
    body = {"model": str(engine.model), "input": "tenant quota"}
    direct, proxied = _both(sidecar, engine, "POST", "/v1/embeddings", acme, json=body)
    assert proxied.status_code == direct.status_code
    assert proxied.status_code != 404 or "KVQuota" not in proxied.text
    if direct.status_code < 500:
        assert proxied.json() == direct.json()
    assert http_post(sidecar.url + "/v1/embeddings", json=body, timeout=30
                     ).status_code == 401


def test_responses_are_served_with_the_tenants_token_ceiling(
    sidecar: Harness, engine: Any, keys: Keys, acme: dict[str, str],
) -> None:
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key=keys.hs("acme"),
                           max_retries=0, timeout=60)
    response = client.responses.create(model=str(engine.model), input="tenant quota",
                                       max_output_tokens=500)
    assert response.status == "completed" or response.incomplete_details is not None
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= MAX_TOKENS  # clamped from 500
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=str(engine.model), input="x", background=True)


def test_an_unknown_route_gets_a_404_naming_the_supported_ones(
    sidecar: Harness, acme: dict[str, str],
) -> None:
    response = http_post(sidecar.url + "/reset_prefix_cache", headers=acme, timeout=30)
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    for route in ("/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/tokenize",
                  "/detokenize", "/health", "/ping", "/version", "/metrics"):
        assert route in message
