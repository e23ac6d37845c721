"""The operator's Prometheus metrics (port `metrics`, 9090, `/metrics`).

One module owns every metric name (the contract with dashboards and alerts, listed in
docs/operator.md, "Metrics"); the reconciler, the handlers and the admission webhook
record through the helpers below. Metrics live in prometheus-client's default registry
(one operator per process), served by `serve_metrics` from its own thread, so a scrape
is answered even while the event loop is busy planning a large pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from kvquota.api import ConditionReason

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

disable_created_metrics()  # no `_created` series: they double what a scrape carries

# Reconciles of a large pool take seconds on a busy node; edits land well under one.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

RECONCILES = Counter(
    "kvquota_operator_reconciles", "Reconciles by the kind that triggered them and result.",
    ["kind", "result"],
)
RECONCILE_SECONDS = Histogram(
    "kvquota_operator_reconcile_duration_seconds",
    "Duration of a reconcile (policy, then status), by triggering kind.",
    ["kind"], buckets=_LATENCY_BUCKETS,
)
CHANGE_TO_CONFIGMAP = Histogram(
    "kvquota_operator_change_to_configmap_seconds",
    "From the operator seeing a change to the pool's ConfigMap holding its effect.",
    buckets=_LATENCY_BUCKETS,
)
POLICY_WRITES = Counter(
    "kvquota_operator_policy_writes", "Policy ConfigMaps created or patched.",
)
ENGINES_OBSERVED = Gauge(
    "kvquota_operator_engines_observed", "Ready engines of the pool at its last poll.",
    ["namespace", "pool"],
)
ENGINES_STALE = Gauge(
    "kvquota_operator_engines_stale",
    "Ready engines not running the pool's current policy (older version or no report).",
    ["namespace", "pool"],
)
QUOTAS_REFUSED = Gauge(
    "kvquota_operator_quotas_refused", "TenantQuotas of the pool with Accepted=False.",
    ["namespace", "pool", "reason"],
)
WEBHOOK_CALLS = Counter(
    "kvquota_operator_webhook_calls", "Admission webhook calls by kind, operation, result.",
    ["kind", "operation", "result"],
)
ENGINE_GUARANTEED = Gauge(
    "kvquota_operator_engine_guaranteed_blocks",
    "A tenant's guaranteed blocks on one engine (tenants the demand-driven split moved).",
    ["namespace", "pool", "tenant_id", "engine"],
)
ENGINE_MAX = Gauge(
    "kvquota_operator_engine_max_blocks",
    "A tenant's block ceiling on one engine (tenants the demand-driven split moved).",
    ["namespace", "pool", "tenant_id", "engine"],
)
SPLIT_TENANT_LIMIT = 100  # tenants per pool with per-engine series (label cardinality)
REFUSAL_REASONS = (ConditionReason.OVERSUBSCRIBED, ConditionReason.INVALID_SPEC,
                   ConditionReason.DUPLICATE_TENANT)
_split_series: dict[tuple[str, str], set[tuple[str, str]]] = {}  # pool -> (tenant, engine)


def record_webhook_call(kind: str, operation: str, result: str) -> None:
    """For the admission webhook: count one call (`result`: allowed, denied, error)."""
    WEBHOOK_CALLS.labels(kind=kind, operation=operation, result=result).inc()


@contextmanager
def timed_reconcile(kind: str) -> Iterator[None]:
    """Count and time one handler's reconcile; an exception counts as `error`."""
    start = time.perf_counter()
    result = "error"
    try:
        yield
        result = "ok"
    finally:
        RECONCILES.labels(kind=kind, result=result).inc()
        RECONCILE_SECONDS.labels(kind=kind).observe(time.perf_counter() - start)


def set_engines(namespace: str, pool: str, *, observed: int, stale: int) -> None:
    ENGINES_OBSERVED.labels(namespace=namespace, pool=pool).set(observed)
    ENGINES_STALE.labels(namespace=namespace, pool=pool).set(stale)


def set_refused(namespace: str, pool: str, counts: Mapping[str, int]) -> None:
    for reason in REFUSAL_REASONS:
        QUOTAS_REFUSED.labels(namespace=namespace, pool=pool, reason=reason).set(
            counts.get(reason, 0))


def set_engine_split(namespace: str, pool: str,
                     rows: Mapping[tuple[str, str], tuple[int, int]]) -> None:
    """The pool's per-engine split, `(tenant_id, engine) -> (guaranteed, maximum)`:
    these series replace the pool's previous ones."""
    tenants = sorted({tenant for tenant, _ in rows})[:SPLIT_TENANT_LIMIT]
    keep = {key for key in rows if key[0] in set(tenants)}
    for tenant, engine in _split_series.get((namespace, pool), set()) - keep:
        for gauge in (ENGINE_GUARANTEED, ENGINE_MAX):
            with suppress(KeyError):
                gauge.remove(namespace, pool, tenant, engine)
    for tenant, engine in sorted(keep):
        guaranteed, maximum = rows[(tenant, engine)]
        labels = {"namespace": namespace, "pool": pool, "tenant_id": tenant, "engine": engine}
        ENGINE_GUARANTEED.labels(**labels).set(guaranteed)
        ENGINE_MAX.labels(**labels).set(maximum)
    _split_series[(namespace, pool)] = keep


def forget_pool(namespace: str, pool: str) -> None:
    """A deleted pool's series go (a scrape would otherwise keep its last values)."""
    set_engine_split(namespace, pool, {})
    _split_series.pop((namespace, pool), None)
    for gauge in (ENGINES_OBSERVED, ENGINES_STALE):
        with suppress(KeyError):
            gauge.remove(namespace, pool)
    for reason in REFUSAL_REASONS:
        with suppress(KeyError):
            QUOTAS_REFUSED.remove(namespace, pool, reason)


class MetricsServer:
    """`/metrics` on `host:port` from a thread of its own; `close` frees the port."""

    def __init__(self, host: str, port: int) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host)

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` or `:PORT` (all interfaces) -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics address {address!r}: expected HOST:PORT, e.g. 0.0.0.0:9090")
    return host or "0.0.0.0", int(port)
