"""Alerts, scrape targets and the Grafana dashboard agree with the metric contract and
with the pods they watch."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from .conftest import MANIFESTS, build, one

RULES_FILE = MANIFESTS / "monitoring" / "prometheusrule.yaml"
OUR_METRIC = re.compile(r"\b(?:vllm_tenant|kvquota)_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _contract() -> set[str]:
    """Metric names listed in the comment block at the top of the rule file."""
    header = []
    for line in RULES_FILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return set(OUR_METRIC.findall("\n".join(header)))


def _base(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in _contract():
            return name[: -len(suffix)]
    return name


def _monitoring() -> list[dict[str, Any]]:
    return build("manifests/monitoring")


def _alerts() -> dict[str, dict[str, Any]]:
    rule = one(_monitoring(), "PrometheusRule")
    return {r["alert"]: {**r, "group": g} for g in rule["spec"]["groups"] for r in g["rules"]}


def _dashboard() -> dict[str, Any]:
    cm = one(_monitoring(), "ConfigMap", "kvquota-grafana-dashboard")
    (text,) = cm["data"].values()
    dashboard: dict[str, Any] = json.loads(text)
    return dashboard


def _panel_exprs() -> dict[str, list[str]]:
    return {
        p["title"]: [t["expr"] for t in p.get("targets", [])]
        for p in _dashboard()["panels"] if p["type"] != "row"
    }


def _all_exprs() -> list[str]:
    exprs = [a["expr"] for a in _alerts().values()]
    return exprs + [e for panel in _panel_exprs().values() for e in panel]


def test_premium_eviction_pages_after_ten_seconds() -> None:
    alert = _alerts()["KVQuotaPremiumTenantEvicted"]
    assert 'vllm_tenant_kv_cache_evictions_total{priority="0"}' in alert["expr"]
    assert re.search(r"increase\(.*\[1m\]\)", alert["expr"], re.S)
    assert alert["expr"].rstrip().endswith("> 0")
    assert alert["for"] == "10s"
    assert alert["labels"]["severity"] == "critical"
    # Rules are evaluated once per group interval: a 10 s `for` needs a 10 s interval.
    assert alert["group"]["interval"] == "10s"


@pytest.mark.parametrize("metric", [
    "kvquota_lease_breaks_total",
    "kvquota_degraded_events_total",
    'kvquota_admissions_total{decision="rejected_watermark"}',
    "kvquota_engine_free_blocks",
    "kvquota_policy_errors_total",
    "kvquota_policy_info",
])
def test_an_alert_watches(metric: str) -> None:
    assert any(metric in a["expr"] for a in _alerts().values())


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for name, alert in _alerts().items():
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert alert["annotations"]["summary"], name


def test_alerts_and_dashboard_use_only_metrics_of_the_contract() -> None:
    contract = _contract()
    assert len(contract) >= 12
    used = {_base(m) for expr in _all_exprs() for m in OUR_METRIC.findall(expr)}
    assert used - contract == set()


def test_queries_are_valid_promql() -> None:
    promql = pytest.importorskip("promql_parser", reason="pip install promql-parser")
    grafana_vars = {"$__rate_interval": "5m", "$namespace": "ns", "$pool": "p", "$tenant": "t"}
    for expr in _all_exprs():
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"undefined dashboard variable in {expr}"
        promql.parse(expr)  # raises ValueError on a syntax error


def test_dashboard_shows_blocks_admissions_evictions_latency_and_free_blocks() -> None:
    shown = {_base(m) for exprs in _panel_exprs().values() for e in exprs
             for m in OUR_METRIC.findall(e)}
    assert {
        "kvquota_tenant_blocks_used", "kvquota_tenant_blocks_reserved",
        "kvquota_tenant_blocks_leased", "kvquota_admissions_total",
        "vllm_tenant_kv_cache_evictions_total", "kvquota_upstream_ttft_seconds",
        "kvquota_engine_free_blocks",
    } <= shown
    ttft = [e for exprs in _panel_exprs().values() for e in exprs if "ttft" in e]
    assert ttft and all(e.startswith("histogram_quantile(") for e in ttft)


def test_dashboard_is_loaded_by_the_grafana_sidecar() -> None:
    cm = one(_monitoring(), "ConfigMap", "kvquota-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = _dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {m for e in _all_exprs() for m in re.findall(r"\$(\w+)", e)} - {"__rate_interval"}
    assert used <= defined


def test_engine_podmonitor_scrapes_the_sidecar_of_every_engine() -> None:
    monitor = one(_monitoring(), "PodMonitor", "kvquota-engines")
    engine = one(build("manifests/examples/gpu-engine"), "Deployment", "vllm-engine")
    pod = engine["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: c["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert ports[endpoint["port"]] == "kvquota-sidecar"
    assert endpoint["path"] == "/metrics"
    # The `pool` label the alerts group by.
    assert any(r["targetLabel"] == "pool" for r in endpoint["relabelings"])


def test_operator_podmonitor_matches_the_operator_pod() -> None:
    monitor = one(_monitoring(), "PodMonitor", "kvquota-operator")
    operator = one(build("manifests/base"), "Deployment", "kvquota-operator")
    pod = operator["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert one(_monitoring(), "PodMonitor", "kvquota-operator")["metadata"]["namespace"] == (
        operator["metadata"]["namespace"]
    )
