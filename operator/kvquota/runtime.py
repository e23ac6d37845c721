"""Process-wide state the kopf handlers share through kopf's `memo`.

`OperatorConfig` is fixed before kopf starts (CLI flags, or the embedding test or
benchmark); `Runtime` is built once in the startup handler and closed at cleanup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvquota.kube import Timeouts
from kvquota.quota_changes import QuotaChanges

if TYPE_CHECKING:
    import httpx

    from kvquota.inject.webhook import WebhookConfig
    from kvquota.kube import KubeApi
    from kvquota.metrics import MetricsServer
    from kvquota.reconciler import PoolReconciler


@dataclass(frozen=True)
class OperatorConfig:
    api_server: str | None = None  # embedding only: an API URL used without credentials
    poll_interval: float = 10.0  # seconds between engine polls of a pool
    engine_timeout: float = 2.0  # one sidecar status request
    degraded_window: float = 300.0  # Degraded looks at disruptions this far back
    status_concurrency: int = 16  # parallel status patches during a fan-out
    metrics_address: tuple[str, int] | None = None  # serve /metrics here (host, port)
    peering_lifetime: int = 60  # seconds peers trust our keep-alive (kopf's default)
    # Clock (seconds) of the disruption window; tests substitute one they advance.
    clock: Callable[[], float] = time.monotonic
    timeouts: Timeouts = field(default_factory=Timeouts)
    # The sidecar injection webhook; None: plain HTTP on loopback (embedding only).
    webhook: WebhookConfig | None = None


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

    from kvquota.engines import EnginePoller
    from kvquota.kube import KubeApi, api_client
    from kvquota.metrics import MetricsServer
    from kvquota.reconciler import PoolReconciler

    kube = KubeApi(api_client(config.api_server), config.timeouts)
    # Pod IPs are cluster-internal: no proxies from the environment, no cookies.
    http = httpx.AsyncClient(trust_env=False, follow_redirects=False)
    poller = EnginePoller(kube, http, config.engine_timeout, config.clock)
    served = MetricsServer(*config.metrics_address) if config.metrics_address else None
    return Runtime(config, kube, http, PoolReconciler(kube, poller, config), served)


def runtime_of(memo: Any) -> Runtime:
    runtime: Runtime = memo.runtime
    return runtime
