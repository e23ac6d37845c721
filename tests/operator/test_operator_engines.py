"""Finding engine pods and their sidecar status endpoints (pure)."""

from __future__ import annotations

from typing import Any

from kvquota.api import LabelSelector
from kvquota.reconcile.engines import (
    gateway_selector,
    is_ready,
    selector_matches,
    selector_string,
    status_url,
)

SELECTOR = LabelSelector.model_validate({
    "matchLabels": {"app": "vllm"},
    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "cpu"]},
                         {"key": "canary", "operator": "DoesNotExist"}],
})


def _pod(ip: str = "10.0.0.7", ready: str = "True", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "engine-0", **meta},
        "spec": {"containers": [
            {"name": "vllm", "ports": [{"name": "http", "containerPort": 8001}]},
            {"name": "kvquota-sidecar", "ports": [{"name": "http", "containerPort": 8000},
                                                  {"name": "admin", "containerPort": 9200}]},
        ]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_selector_is_sent_to_the_api_and_checked_locally() -> None:
    assert selector_string(SELECTOR) == "app=vllm,tier in (gpu,cpu),!canary"
    assert selector_matches(SELECTOR, {"app": "vllm", "tier": "gpu"})
    assert not selector_matches(SELECTOR, {"app": "vllm", "tier": "tpu"})
    assert not selector_matches(SELECTOR, {"app": "vllm", "tier": "gpu", "canary": "1"})


def test_only_ready_pods_with_an_ip_that_are_not_terminating_count() -> None:
    assert is_ready(_pod())
    assert not is_ready(_pod(ready="False"))
    assert not is_ready(_pod(ip=""))
    assert not is_ready(_pod(deletionTimestamp="2026-01-01T00:00:00Z"))


def test_status_endpoint_is_the_sidecar_admin_port_never_the_client_port() -> None:
    assert status_url(_pod()) == "http://10.0.0.7:9200/kvquota/status"
    assert status_url(_pod(ip="fd00::7")) == "http://[fd00::7]:9200/kvquota/status"
    annotated = _pod(annotations={"kvquota.dev/status-port": "9300"})
    assert status_url(annotated) == "http://10.0.0.7:9300/kvquota/status"
    unnamed = _pod()
    unnamed["spec"]["containers"][1]["ports"] = [{"name": "http", "containerPort": 8000}]
    assert status_url(unnamed) == "http://10.0.0.7:9100/kvquota/status"  # the default


def test_gateway_api_pool_selectors_v1_and_v1alpha2() -> None:
    v1 = {"spec": {"selector": {"matchLabels": {"app": "x"}}}}
    v1alpha2 = {"spec": {"selector": {"app": "x"}}}
    assert gateway_selector(v1) == gateway_selector(v1alpha2) == LabelSelector(
        match_labels={"app": "x"})
    assert gateway_selector({"spec": {}}) is None
