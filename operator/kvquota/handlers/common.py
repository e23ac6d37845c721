"""What the per-kind handler modules share: the process-wide `Runtime` (built once in
the startup handler, kept in kopf's `memo`, closed at cleanup) and small helpers."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.names import GROUP, VERSION
from kvquota.reconcile.quota_changes import QuotaChanges
from kvquota.runtime import OperatorConfig

if TYPE_CHECKING:
    import httpx

    from kvquota.metrics import MetricsServer
    from kvquota.reconcile.kube import KubeApi
    from kvquota.reconcile.reconciler import PoolReconciler

BACKOFF = 5.0  # seconds before kopf retries a failed handler
KEPT_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion",
                 "creationTimestamp", "deletionTimestamp")

__all__ = ["BACKOFF", "GROUP", "VERSION", "Runtime", "build_runtime", "deleted", "retrying",
           "runtime_of", "snapshot"]


def deleted(type: str, **_: Any) -> bool:
    """`when=` filter of event handlers: only the final DELETED event (kopf then skips
    the call, and its log line, for the thousands of other events)."""
    return type == "DELETED"


def snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an index keeps of an object: identity, spec and status (no managedFields
    or annotations, which include kopf's copy of the spec). The index functions that
    call it are `async`: kopf runs a plain function in a thread, a hop per event."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: copy.deepcopy(meta[k]) for k in KEPT_METADATA if k in meta},
        "spec": copy.deepcopy(dict(body.get("spec") or {})),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


async def retrying(
    action: Callable[[], Awaitable[None]], logger: logging.Logger | Any, attempts: int = 5
) -> None:
    """For event handlers, whose failures kopf only logs: retry a few times with backoff."""
    for attempt in range(attempts):
        try:
            await action()
            return
        except Exception:
            if attempt == attempts - 1:
                raise
            logger.warning("reconcile failed, retrying", exc_info=True)
            await asyncio.sleep(min(2**attempt, BACKOFF))


@dataclass
class Runtime:
    config: OperatorConfig
    kube: KubeApi
    http: httpx.AsyncClient
    reconciler: PoolReconciler
    metrics: MetricsServer | None = None
    quota_changes: QuotaChanges = field(default_factory=QuotaChanges)

    async def aclose(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        await self.http.aclose()


def build_runtime(config: OperatorConfig) -> Runtime:
    import httpx

    from kvquota.metrics import MetricsServer
    from kvquota.reconcile.engines import EnginePoller
    from kvquota.reconcile.kube import KubeApi, api_client
    from kvquota.reconcile.reconciler import PoolReconciler

    kube = KubeApi(api_client(config.api_server), config.timeouts)
    # Pod IPs are cluster-internal: no proxies from the environment, no cookies.
    http = httpx.AsyncClient(trust_env=False, follow_redirects=False)
    poller = EnginePoller(kube, http, config.engine_timeout, config.clock)
    served = MetricsServer(*config.metrics_address) if config.metrics_address else None
    return Runtime(config, kube, http, PoolReconciler(kube, poller, config), served)


def runtime_of(memo: Any) -> Runtime:
    runtime: Runtime = memo.runtime
    return runtime
