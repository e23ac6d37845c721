"""Operator-wide handlers: settings and runtime at startup, login, probe, cleanup."""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import dataclasses
import re
from typing import Any

import kopf

from kvquota.handlers.common import Runtime, build_runtime, runtime_of
from kvquota.reconcile.kube import USER_AGENT, PeeringSetup, peering_crd
from kvquota.runtime import OperatorConfig
from kvquota.settings import configure_settings

# A namespace name, not one of kopf's patterns (`kvquota-*`, `!kube-system`): only
# there can the operator create the peering object itself.
_NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class PeeringUnavailable(kopf.PermanentError):
    """--require-peering cannot work: kopf would keep this replica paused for ever."""


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
    if not settings.peering.standalone:
        await _ensure_peering(runtime, settings, logger)


async def _ensure_peering(runtime: Runtime, settings: kopf.OperatorSettings,
                          logger: kopf.Logger) -> None:
    """Create the peering objects the replicas meet in (before kopf's peering starts):
    the ClusterKopfPeering, or with --namespace a KopfPeering in each watched namespace,
    so an install needs no custom object applied after its CRD. Where that fails, a
    required peering would leave this replica paused for ever, saying so only at debug
    level: it stops instead, naming the missing CRD or permission."""
    name = settings.peering.name
    if settings.peering.clusterwide:
        namespaces: list[str | None] = [None]
    else:
        namespaces = [ns for ns in runtime.config.namespaces if _NAMESPACE_NAME.fullmatch(ns)]
        for pattern in sorted(set(runtime.config.namespaces) - set(namespaces)):
            logger.info("--namespace %s is a pattern: create the KopfPeering %r in each "
                        "namespace it matches", pattern, name)
    for namespace in namespaces:
        setup = await runtime.kube.ensure_peering(name, namespace)
        if setup is PeeringSetup.READY:
            continue
        problem = _peering_problem(setup, name, namespace)
        if settings.peering.mandatory:
            logger.error("%s; --require-peering cannot work without it: stopping", problem)
            raise PeeringUnavailable(f"--require-peering: {problem}")
        logger.warning("%s; running without peering (fine for a single replica)", problem)


def _peering_problem(setup: PeeringSetup, name: str, namespace: str | None) -> str:
    crd = peering_crd(namespace)
    kind = f"KopfPeering {name!r} in namespace {namespace}" if namespace else (
        f"ClusterKopfPeering {name!r}")
    if setup is PeeringSetup.CRD_MISSING:
        return (f"kopf's peering CRD {crd} is not installed, so the {kind} cannot exist "
                "(kubectl apply --server-side -k manifests/crds)")
    return (f"the operator's account may not create the {kind}: its role needs get, list, "
            f"watch, patch and create on {crd} (manifests/base/rbac.yaml)")


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
        return _Connection(server=config.api_server, insecure=True)
    info = kopf.login_via_client(logger=logger, settings=settings, **kwargs)
    if info is None:
        return None
    return _Connection(**{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Connection(kopf.ConnectionInfo):
    """kopf's connection, sending our User-Agent: kopf's writes (handled-spec
    annotations, events, peering keep-alives) pass no fieldManager, so the API server
    names their manager after it, `kvquota-operator` like the rest of ours."""

    def as_http_headers(self) -> dict[str, str]:
        return {**super().as_http_headers(), "User-Agent": USER_AGENT}


@kopf.on.probe(id="reconciles")
def reconciles(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: pool reconciles since start (the probe fails if kopf hangs)."""
    return runtime_of(memo).reconciler.reconciles if "runtime" in memo else 0
