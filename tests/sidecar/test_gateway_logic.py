"""Gateway behaviour against a recording stub engine: rewriting, errors, policy, metrics."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.stats import EngineStats, SidecarStatus, TenantEngineStats
from engine_sidecar.gateway.policy.active import cache_salt
from kvquota_lab.processes import free_port

from .conftest import StubFactory
from .helpers import WAIT, Keys, http_get, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _status(url: str) -> SidecarStatus:
    return SidecarStatus.model_validate_json(http_get(url + "/kvquota/status").content)


def test_forwarded_body_overwrites_priority_xargs_and_salt(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", tier="premium", priority=0, max_tokens=64)))
    body = {
        "prompt": "tenant quota cache", "max_tokens": 1000, "priority": -100,
        "vllm_xargs": {"kvq_tenant": "victim", "kvq_session": "theirs", "other": 1},
        "cache_salt": "client-chosen", "user": "session-from-user",
    }
    headers = {**_bearer(keys.hs("acme")), "Cookie": "sid=1", "X-Session-Id": "s-42"}
    response = http_post(harness.url + "/v1/completions", json=body, headers=headers)

    assert response.status_code == 200, response.text
    (sent,) = stub.received
    salt_secret = (keys.dir / "cache-salt").read_bytes()
    assert sent["priority"] == 0
    # The client's "other" is gone; the sidecar's own: tenant, session, and the blocks
    # reserved per sequence (3 prompt tokens + the tier default of 8: one block) and
    # of which output tokens.
    assert sent["vllm_xargs"] == {"kvq_tenant": "acme", "kvq_session": "s-42",
                                  "kvq_reserved_blocks": 1, "kvq_reserved_output_tokens": 8}
    assert sent["cache_salt"] == cache_salt(salt_secret, "acme") != "client-chosen"
    assert sent["max_tokens"] == 64
    (sent_headers,) = stub.received_headers
    assert "authorization" not in sent_headers and "cookie" not in sent_headers


def test_chat_clamps_through_max_completion_tokens_and_shared_isolation_drops_salt(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme", max_tokens=32, prefix_cache_isolation="Shared")))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
            "max_completion_tokens": 400, "cache_salt": "mine", "user": "u-7"}
    response = http_post(harness.url + "/v1/chat/completions", json=body,
                         headers=_bearer(keys.hs("acme")))

    assert response.status_code == 200, response.text
    (sent,) = stub.received
    assert sent["max_completion_tokens"] == 32 and "max_tokens" not in sent
    assert "cache_salt" not in sent
    assert sent["vllm_xargs"] == {"kvq_tenant": "acme", "kvq_session": "u-7",
                                  "kvq_reserved_blocks": 1, "kvq_reserved_output_tokens": 8}
    assert response.json()["usage"]["completion_tokens"] == 32


PLANES = pytest.mark.parametrize("plane", ["auto", "httpx"])  # fast path and fallback


@PLANES
def test_streams_relay_headers_minus_hop_by_hop_and_cookies(
    stub_sidecar: StubFactory, keys: Keys, plane: str
) -> None:
    harness, _stub = stub_sidecar(StubEngine(chunks=5), data_plane=plane)
    harness.apply(make_policy(tenant("acme")))
    with httpx.stream("POST", harness.url + "/v1/completions",
                      json={"prompt": "x", "stream": True},
                      headers=_bearer(keys.hs("acme"))) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-upstream"] == "stub"
    assert "set-cookie" not in response.headers
    assert events[-1] == "data: [DONE]" and len(events) == 7
    assert harness.wait_ledger_empty()


@PLANES
def test_engine_down_is_503_and_not_ready(
    stub_sidecar: StubFactory, keys: Keys, plane: str
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    harness, _ = stub_sidecar(wait_up=False, upstream=closed, data_plane=plane)
    harness.apply(make_policy(tenant("acme")))

    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))
    ready = http_get(harness.url + "/readyz")

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "ENGINE_UNAVAILABLE"
    assert response.headers["retry-after"] == "1"
    assert "127.0.0.1" not in response.text  # no internal addresses
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert harness.wait_ledger_empty()


def test_engine_5xx_is_mapped_without_its_body(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, _ = stub_sidecar(StubEngine(mode="error500"))
    harness.apply(make_policy(tenant("acme")))
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "UPSTREAM_ERROR"
    assert "exploded" not in response.text
    assert harness.wait_ledger_empty()


@PLANES
def test_upstream_timeout_is_504(stub_sidecar: StubFactory, keys: Keys, plane: str) -> None:
    harness, _ = stub_sidecar(StubEngine(mode="hang_headers"), request_timeout=0.3,
                              data_plane=plane)
    harness.apply(make_policy(tenant("acme")))
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "UPSTREAM_TIMEOUT"
    assert harness.wait_ledger_empty()


@PLANES
@pytest.mark.parametrize(("mode", "code"), [("hang_midstream", "UPSTREAM_TIMEOUT"),
                                            ("drop_midstream", "UPSTREAM_ERROR")])
def test_failure_mid_stream_ends_the_stream_with_an_error_event(
    stub_sidecar: StubFactory, keys: Keys, mode: str, code: str, plane: str
) -> None:
    harness, _ = stub_sidecar(StubEngine(mode=mode), request_timeout=0.3, data_plane=plane)
    harness.apply(make_policy(tenant("acme")))
    with httpx.stream("POST", harness.url + "/v1/completions",
                      json={"prompt": "x", "stream": True},
                      headers=_bearer(keys.hs("acme"))) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == code
    assert harness.wait_ledger_empty()


@PLANES
def test_a_client_that_leaves_mid_stream_ends_the_engine_request(
    stub_sidecar: StubFactory, keys: Keys, plane: str
) -> None:
    # The stub streams one chunk and then nothing until its connection closes, so only
    # the sidecar acting on the client's leaving can end this request.
    harness, stub = stub_sidecar(StubEngine(mode="until_disconnect"), data_plane=plane)
    harness.apply(make_policy(tenant("acme")))
    with httpx.stream("POST", harness.url + "/v1/completions",
                      json={"prompt": "x", "stream": True},
                      headers=_bearer(keys.hs("acme"))) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_for(lambda: stub.disconnects == 1, WAIT, "the engine's connection stayed open")
    assert harness.wait_ledger_empty()
    metrics = http_get(harness.admin_url + "/metrics").text
    assert 'kvquota_reservations_total{outcome="cancelled",tier="standard"} 1.0' in metrics


def test_no_policy_means_503_and_not_ready(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, _ = stub_sidecar()
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))
    ready = http_get(harness.admin_url + "/readyz").json()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "POLICY_NOT_LOADED"
    assert ready["ready"] is False
    assert any("not found" in reason for reason in ready["reasons"])


def test_bad_policy_keeps_the_last_good_one(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, _ = stub_sidecar()
    good = harness.apply(make_policy(tenant("acme", max_tokens=16)))
    errors_before = harness.gateway.metrics.policy_errors._value.get()
    write_atomically(harness.policy_file, json.dumps({"pool": "default/test", "tenants": 3}))
    wait_for(lambda: harness.gateway.holder.error, WAIT, "bad policy not noticed")

    status = _status(harness.admin_url)
    metrics = http_get(harness.admin_url + "/metrics").text
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))

    assert status.policy_version == good.version and status.ready
    assert status.policy_error and "invalid EnginePolicy" in status.policy_error
    assert f"kvquota_policy_errors_total {errors_before + 1}" in metrics
    assert "tenants: Input should be" in status.policy_error
    assert f'kvquota_policy_info{{pool="default/test",version="{good.version}"}} 1.0' in metrics
    assert response.status_code == 200


def test_policy_needing_a_missing_secret_is_refused(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar()
    good = harness.apply(make_policy(tenant("acme")))
    bad = make_policy(tenant("acme"), auth={"jwt": {"key_file": "no-such-key",
                                                     "algorithms": ["RS256"]}})
    write_atomically(harness.policy_file, bad.to_json())
    wait_for(lambda: harness.gateway.holder.error, WAIT, "bad policy not noticed")
    status = _status(harness.admin_url)
    assert status.policy_version == good.version
    assert status.policy_error and "'no-such-key' not found" in status.policy_error
    assert str(keys.dir) not in status.policy_error


def test_unknown_routes_and_methods_answer_openai_errors(stub_sidecar: StubFactory) -> None:
    harness, _ = stub_sidecar()
    missing = http_get(harness.url + "/v1/audio/transcriptions")
    wrong_method = http_get(harness.url + "/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"
    assert "/v1/chat/completions" in missing.json()["error"]["message"]  # what exists
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "METHOD_NOT_ALLOWED"


def test_oversized_body_is_413(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, stub = stub_sidecar(max_body_bytes=1024)
    harness.apply(make_policy(tenant("acme")))
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x" * 4096},
                         headers=_bearer(keys.hs("acme")))
    assert response.status_code == 413 and not stub.received


def test_tenant_labels_are_capped(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, _ = stub_sidecar(tenant_label_limit=2)
    harness.apply(make_policy(tenant("t1"), tenant("t2"), tenant("t3")))
    for tenant_id in ("t1", "t2", "t3", "stranger"):
        http_post(harness.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                  headers=_bearer(keys.hs(tenant_id)))
    metrics = http_get(harness.admin_url + "/metrics").text
    admitted = [line for line in metrics.splitlines()
                if line.startswith("kvquota_admissions_total")]
    labels = {line.split('tenant_id="')[1].split('"')[0] for line in admitted}
    assert labels == {"t1", "t2", "other", "unknown"}


def test_status_and_metrics_merge_the_plugin_stats(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: pytest.TempPathFactory
) -> None:
    stats_path = tmp_path / "stats.json"  # type: ignore[operator]
    harness, _ = stub_sidecar(stats_path=stats_path)
    harness.apply(make_policy(tenant("acme", tier="premium", priority=0), tenant("free")))
    stats = EngineStats(
        timestamp=time.time(), policy_version="x", total_blocks=1000, free_blocks=700,
        preemption_mode="offload", preemptions_by_mode={"offload": 2, "recompute": 1},
        tenants={"acme": TenantEngineStats(running_blocks=20, leased_blocks=30,
                                           leased_sessions=2, lease_breaks=1,
                                           preemptions={"borrower": 3}),
                 "ghost": TenantEngineStats(running_blocks=5)},
    )
    stats_path.write_text(stats.model_dump_json(by_alias=True))
    http_post(harness.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
              headers=_bearer(keys.hs("acme")))
    time.sleep(0.15)  # the reader re-stats at most every 0.1 s

    status = _status(harness.admin_url)
    metrics = http_get(harness.admin_url + "/metrics").text

    acme = status.tenants["acme"]
    assert (status.total_blocks, status.capacity_source) == (1000, "engine")
    assert status.free_blocks == 700
    assert (acme.usage.blocks, acme.usage.leased_blocks, acme.usage.leased_sessions) == \
        (50, 30, 2)
    assert (acme.counters.admitted, acme.counters.preemptions, acme.counters.lease_breaks) \
        == (1, 3, 1)
    assert 'vllm_tenant_kv_cache_evictions_total{preemption_reason="borrower",' \
           'priority="0",tenant_id="acme"} 3.0' in metrics
    assert 'kvquota_tenant_blocks_leased{tenant_id="acme"} 30.0' in metrics
    assert 'kvquota_tenant_blocks_used{tenant_id="other"} 5.0' in metrics
    assert "kvquota_engine_free_blocks 700.0" in metrics
    assert 'vllm_tenant_active_swapped_blocks{tenant_id="acme"} 0.0' in metrics
    assert 'kvquota_engine_preemptions_total{mode="offload"} 2.0' in metrics
    assert 'kvquota_engine_preemptions_total{mode="recompute"} 1.0' in metrics


def test_unknown_capacity_skips_the_watermark_and_says_so(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar()
    harness.apply(make_policy(tenant("acme", guaranteed_blocks=0), watermark=0.49))
    response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))
    status = _status(harness.admin_url)
    assert response.status_code == 200
    assert status.capacity_source is None and status.total_blocks == 0


def test_absurd_token_times_are_401_not_500(stub_sidecar: StubFactory, keys: Keys) -> None:
    harness, stub = stub_sidecar()
    harness.apply(make_policy(tenant("acme")))
    for exp in (10**400, str(int(time.time()) + 300)):
        response = http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                             headers=_bearer(keys.hs("acme", exp=exp)))
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"
        assert "'exp'" in response.json()["error"]["message"]
    assert not stub.received


def test_a_request_naming_its_caller_twice_is_400(stub_sidecar: StubFactory, keys: Keys) -> None:
    """Two credentials must not resolve to whichever came last."""
    harness, stub = stub_sidecar()
    harness.apply(make_policy(
        tenant("acme"), tenant("gw"),
        auth={"jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"]},
              "trusted_tenant_header": "X-Fairness-Id"},
    ))
    url = harness.url + "/v1/completions"
    acme, gw = (f"Bearer {keys.hs(t)}" for t in ("acme", "gw"))
    twice = http_post(url, json={"prompt": "x"},
                      headers=[("Authorization", acme), ("Authorization", gw)])
    header_twice = http_post(url, json={"prompt": "x"},
                             headers=[("X-Fairness-Id", "gw"), ("X-Fairness-Id", "acme")])
    models = http_get(harness.url + "/v1/models",
                      headers=[("Authorization", acme), ("Authorization", gw)])
    for response in (twice, header_twice, models):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "INVALID_REQUEST"
    assert not stub.received
    assert http_post(url, json={"prompt": "x"}, headers=[("Authorization", gw)]
                     ).status_code == 200


def test_tenants_that_leave_the_policy_free_their_labels(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    harness, _ = stub_sidecar(tenant_label_limit=4)

    def admit_each(*tenant_ids: str) -> set[str]:
        harness.apply(make_policy(*(tenant(t) for t in tenant_ids)))
        for tenant_id in tenant_ids:
            response = http_post(harness.url + "/v1/completions",
                                 json={"prompt": "x", "max_tokens": 1},
                                 headers=_bearer(keys.hs(tenant_id)))
            assert response.status_code == 200, response.text
        metrics = http_get(harness.admin_url + "/metrics").text
        return {line.split('tenant_id="')[1].split('"')[0] for line in metrics.splitlines()
                if 'tenant_id="' in line and not line.startswith("#")}

    assert admit_each("t1", "t2", "t3", "t4") == {"t1", "t2", "t3", "t4"}
    assert admit_each("t5", "t6") == {"t5", "t6"}  # not "other"; t1-t4 are gone


def test_stale_engine_stats_count_as_unknown_capacity(
    stub_sidecar: StubFactory, keys: Keys, tmp_path: pytest.TempPathFactory
) -> None:
    """An engine that died leaves its last stats file behind: a cache that was full
    then must not refuse requests forever (nor a free one admit them)."""
    stats_path = tmp_path / "stats.json"  # type: ignore[operator]
    harness, _ = stub_sidecar(stats_path=stats_path)
    harness.apply(make_policy(tenant("acme", guaranteed_blocks=0, max_queue_seconds=0),
                              watermark=0.2))

    def post_with_stats(age: float) -> httpx.Response:
        stats = EngineStats(timestamp=time.time() - age, total_blocks=1000, free_blocks=0)
        write_atomically(stats_path, stats.model_dump_json(by_alias=True))
        time.sleep(0.15)  # the reader re-stats at most every 0.1 s
        return http_post(harness.url + "/v1/completions", json={"prompt": "x"},
                         headers=_bearer(keys.hs("acme")))

    fresh = post_with_stats(age=0)
    fresh_status = _status(harness.admin_url)
    stale = post_with_stats(age=60)
    status = _status(harness.admin_url)

    assert fresh.status_code == 503, fresh.text  # full cache, a borrowing tenant
    assert fresh_status.capacity_source == "engine"
    assert stale.status_code == 200, stale.text  # admitted on its quota alone
    assert status.capacity_source is None and status.total_blocks == 0
    assert status.engine_stats_stale and not fresh_status.engine_stats_stale
    assert status.engine_stats_age_seconds is not None and status.engine_stats_age_seconds >= 60
