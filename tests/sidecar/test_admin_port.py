"""The client port serves /v1/* and health only; status and metrics live on the admin
port, and nothing either port shows names a path on the server."""

from __future__ import annotations

from engine_sidecar.contract.stats import SidecarStatus

from .conftest import StubFactory
from .helpers import Keys, http_get, http_post, make_policy, tenant
from .stub_engine import StubEngine


def test_status_and_metrics_are_on_the_admin_port_only(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar()
    harness.apply(make_policy(tenant("acme")))
    hidden = http_get(harness.url + "/kvquota/status")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "NOT_FOUND"
    # /metrics on the client port is vLLM's own (forwarded), never the sidecar's.
    assert "kvquota_" not in http_get(harness.url + "/metrics").text
    for route in ("/kvquota/status", "/metrics"):
        assert http_get(harness.admin_url + route).status_code == 200, route
    assert "acme" not in http_get(harness.url + "/kvquota/status").text
    for url in (harness.url, harness.admin_url):
        assert http_get(url + "/healthz").json() == {"status": "alive"}
    client_ready = http_get(harness.url + "/readyz").json()
    assert client_ready == {"ready": True}  # the reasons are on the admin port
    assert http_get(harness.admin_url + "/readyz").json() == {"ready": True, "reasons": []}
    assert http_post(harness.admin_url + "/v1/completions", json={"prompt": "x"},
                     headers={"Authorization": f"Bearer {keys.hs('acme')}"}
                     ).status_code == 404


def test_policy_errors_name_files_not_their_paths(stub_sidecar: StubFactory) -> None:
    harness, _ = stub_sidecar()  # no policy file yet
    status = SidecarStatus.model_validate_json(
        http_get(harness.admin_url + "/kvquota/status").content)
    reasons = http_get(harness.admin_url + "/readyz").json()["reasons"]
    folder = str(harness.policy_file.parent)
    assert status.policy_error == "policy file policy-source.json not found"
    assert any("policy-source.json not found" in reason for reason in reasons)
    assert all(folder not in reason for reason in reasons)


def test_models_show_the_served_name_not_the_engine_path(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    """vLLM started on a directory without --served-model-name lists that path."""
    harness, stub = stub_sidecar(StubEngine(model_id="/models/llama-3-8b"))
    harness.apply(make_policy(tenant("acme"), model="meta-llama/Llama-3-8B"))
    headers = {"Authorization": f"Bearer {keys.hs('acme')}"}

    models = http_get(harness.url + "/v1/models", headers=headers)
    assert models.status_code == 200, models.text
    (card,) = models.json()["data"]
    assert (card["id"], card["root"]) == ("meta-llama/Llama-3-8B", "meta-llama/Llama-3-8B")
    assert "/models" not in models.text
    assert card["max_model_len"] > 0
    # The listed name works; so does the engine's own, for clients that knew it.
    for name in ("meta-llama/Llama-3-8B", "/models/llama-3-8b"):
        response = http_post(harness.url + "/v1/completions",
                             json={"model": name, "prompt": "x"}, headers=headers)
        assert response.status_code == 200, response.text
    assert [sent["model"] for sent in stub.received] == ["/models/llama-3-8b"] * 2
