"""Operator-wide handlers: settings and runtime at startup, login, probe, cleanup."""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

from typing import Any

import kopf

from kvquota.handlers.common import Runtime, build_runtime, runtime_of
from kvquota.runtime import OperatorConfig
from kvquota.settings import configure_settings


@kopf.on.startup()
async def start(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    inferencepools_by_key: kopf.Index[Any, Any],
    tenantquotas_by_pool: kopf.Index[Any, Any],
    logger: kopf.Logger,
    **_: Any,
) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    configure_settings(settings, config)
    runtime = build_runtime(config)
    runtime.reconciler.bind(inferencepools_by_key, tenantquotas_by_pool)
    memo.runtime = runtime
    if not settings.peering.standalone and settings.peering.clusterwide:
        await _ensure_peering(runtime, settings, logger)


async def _ensure_peering(runtime: Runtime, settings: kopf.OperatorSettings,
                          logger: kopf.Logger) -> None:
    """Create the ClusterKopfPeering the replicas meet in (before kopf's peering
    starts), so an install needs no custom object applied after its CRD."""
    if await runtime.kube.ensure_cluster_peering(settings.peering.name):
        return
    if settings.peering.mandatory:
        logger.error("kopf's peering CRD (clusterkopfpeerings.kopf.dev) is not installed: "
                     "--require-peering keeps this replica paused until it is, and the "
                     "operator restarted (kubectl apply -k crds)")


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    if "runtime" in memo:
        await runtime_of(memo).aclose()


@kopf.on.login()
def login(
    memo: kopf.Memo, settings: kopf.OperatorSettings, logger: kopf.Logger, **kwargs: Any
) -> kopf.ConnectionInfo | None:
    """In-cluster service account or kubeconfig (via the kubernetes client); an
    embedding (tests, benchmark) may name a plain API URL instead."""
    config: OperatorConfig | None = memo.get("config")
    if config is not None and config.api_server:
        return kopf.ConnectionInfo(server=config.api_server, insecure=True)
    return kopf.login_via_client(logger=logger, settings=settings, **kwargs)


@kopf.on.probe(id="reconciles")
def reconciles(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: pool reconciles since start (the probe fails if kopf hangs)."""
    return runtime_of(memo).reconciler.reconciles if "runtime" in memo else 0
