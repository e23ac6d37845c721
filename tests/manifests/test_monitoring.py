"""Alerts, scrape targets and the Grafana dashboard agree with the metric contract and
with the pods they watch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    assert alert["for"] == "10s"
    assert alert["labels"]["severity"] == "critical"
    # Rules are evaluated once per group interval: a 10 s `for` needs a 10 s interval.
    assert alert["group"]["interval"] == "10s"


# ------------------------------------------------ the rules, run by Prometheus' promtool

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)"
)
EVICTIONS = (
    'vllm_tenant_kv_cache_evictions_total{{namespace="default", pool="demo-pool", '
    'pod="engine-0", tenant_id="{tenant}", priority="{priority}", '
    'preemption_reason="recompute"}}'
)


def _promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def _write_rules(tmp_path: Path, *, annotations: bool) -> None:
    spec = one(_monitoring(), "PrometheusRule")["spec"]
    if not annotations:  # promtool compares them verbatim; their templates are checked apart
        for group in spec["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))


@needs_promtool
def test_rules_and_their_templates_pass_promtool_check(tmp_path: Path) -> None:
    _write_rules(tmp_path, annotations=True)
    out = _promtool(tmp_path, "check", "rules", "rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize(("case", "tenant", "priority", "values", "fires"), [
    # A sample every 10 s from t=0; `_x6` is the first minute without the series, the
    # eviction lands at t=60s. Checked at 80 s (past `for: 10s`) and 200 s (resolved).
    ("first eviction of a new series", "acme", "0", "_x6 1x20", True),
    ("one more eviction on a known series", "acme", "0", "0x6 1x20", True),
    ("no new eviction", "acme", "0", "2x26", False),
    ("free-tier evictions", "hobbyist", "2", "_x6 5x20", False),
])
def test_premium_eviction_alert(tmp_path: Path, case: str, tenant: str, priority: str,
                                values: str, fires: bool) -> None:
    _write_rules(tmp_path, annotations=False)
    firing = [{"exp_labels": {"severity": "critical", "namespace": "default",
                              "pool": "demo-pool", "pod": "engine-0", "tenant_id": tenant}}]
    checks = [("80s", firing if fires else []), ("200s", [])]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "10s",
        "tests": [{
            "interval": "10s",
            "input_series": [{"series": EVICTIONS.format(tenant=tenant, priority=priority),
                              "values": values}],
            "alert_rule_test": [
                {"eval_time": t, "alertname": "KVQuotaPremiumTenantEvicted", "exp_alerts": e}
                for t, e in checks
            ],
        }],
    }))
    out = _promtool(tmp_path, "test", "rules", "test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


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
    from kvquota.inject.objects import inject_object

    # Its pods as the injection webhook admits them.
    engine = inject_object(one(build("manifests/examples/gpu-engine"), "Deployment",
                               "vllm-engine"))
    pod = engine["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: c["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert ports[endpoint["port"]] == "kvquota-sidecar"
    assert endpoint["port"] == "admin"  # the client port serves no /metrics
    assert endpoint["path"] == "/metrics"
    # The `pool` label the alerts group by.
    assert any(r["targetLabel"] == "pool" for r in endpoint["relabelings"])


def test_operator_podmonitor_matches_the_operator_pod() -> None:
    monitor = one(_monitoring(), "PodMonitor", "kvquota-operator")
    for name in ("kvquota-operator", "kvquota-operator-standby"):  # leader and standby
        operator = one(build("manifests/overlays/ha"), "Deployment", name)
        pod = operator["spec"]["template"]
        assert (monitor["spec"]["selector"]["matchLabels"].items()
                <= pod["metadata"]["labels"].items())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert one(_monitoring(), "PodMonitor", "kvquota-operator")["metadata"]["namespace"] == (
        operator["metadata"]["namespace"]
    )


# ------------------------------------------------ what the sidecar really exposes


def _contract_labels() -> dict[str, set[str]]:
    """name -> labels, from `name{a,b}` entries of the rule file's header."""
    header = RULES_FILE.read_text().split("\napiVersion:")[0]
    return {
        name: set(labels.split(","))
        for name, labels in re.findall(r"((?:vllm_tenant|kvquota)_\w+)\{([\w,]+)\}", header)
    }


def _sidecar_exposition() -> str:
    """One scrape of the sidecar's /metrics registry after some traffic."""
    metrics = pytest.importorskip("engine_sidecar.gateway.telemetry.metrics")
    from prometheus_client import generate_latest

    from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
    from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
    from engine_sidecar.gateway.admission.ledger import Ledger
    from engine_sidecar.gateway.admission.queue import AdmissionQueue
    from engine_sidecar.gateway.policy.active import build as build_active

    acme = TenantPolicy(tenant_id="acme", tier="premium", priority=0, guaranteed_blocks=8,
                        max_blocks_per_engine=16, max_tokens=64, default_max_tokens=32,
                        prefix_cache_isolation="Shared")
    active = build_active(
        EnginePolicy(pool="default/demo-pool", model="m", tenants={"acme": acme}).with_version(),
        None,
    )
    stats = EngineStats(timestamp=0.0, total_blocks=640, free_blocks=320,
                        preemptions_by_mode={"recompute": 1}, tenants={
        "acme": TenantEngineStats(running_blocks=4, leased_blocks=2, lease_breaks=1,
                                  degraded_events=1, preemptions={"borrower": 1}),
    })
    ledger = Ledger()
    ledger.reserve("acme", 3)
    queue = AdmissionQueue(ledger, clock=lambda: 0.0, stats=lambda: stats)
    queue.set_policy(active.policy)
    queue.estimates.observe("acme", "chat", 12)
    gateway = metrics.GatewayMetrics()
    gateway.attach_state(metrics.StateSources(
        ledger=ledger, active=lambda: active, stats=lambda: stats, label=lambda t: t,
        queue=queue,
    ))
    gateway.admissions.labels(tenant_id="acme", tier="premium", decision="admitted").inc()
    gateway.ttft.labels(tier="premium").observe(0.2)
    gateway.policy_errors.inc()
    return str(generate_latest(gateway.registry).decode())


def test_sidecar_exposes_every_metric_of_the_contract_with_its_labels() -> None:
    text = _sidecar_exposition()
    samples: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^(\w+)(?:\{([^}]*)\})? ", text, re.M):
        samples.setdefault(_base(name), set()).update(re.findall(r"(\w+)=", labels))
    missing = sorted(_contract() - set(samples))
    assert missing == [], "the dashboard and alerts query these; the sidecar exposes none"
    for name, labels in _contract_labels().items():
        assert labels <= samples[name], f"{name}: the sidecar lacks labels {labels}"
