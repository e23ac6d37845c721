"""The operator's configuration, fixed before kopf starts (CLI flags, or the
embedding test or benchmark) and handed to the handlers through kopf's `memo`; the
handlers build their shared state from it (`kvquota.handlers.common.Runtime`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvquota.reconcile.kube import Timeouts

if TYPE_CHECKING:
    from kvquota.inject.webhook import WebhookConfig


@dataclass(frozen=True)
class OperatorConfig:
    api_server: str | None = None  # embedding only: an API URL used without credentials
    poll_interval: float = 10.0  # seconds between engine polls of a pool
    engine_timeout: float = 2.0  # one sidecar status request
    degraded_window: float = 300.0  # Degraded looks at disruptions this far back
    status_concurrency: int = 16  # parallel status patches during a fan-out
    metrics_address: tuple[str, int] | None = None  # serve /metrics here (host, port)
    peering_lifetime: int = 60  # seconds peers trust our keep-alive (kopf's default)
    namespaces: tuple[str, ...] = ()  # --namespace: watched namespaces (none: all)
    # Clock (seconds) of the disruption window; tests substitute one they advance.
    clock: Callable[[], float] = time.monotonic
    timeouts: Timeouts = field(default_factory=Timeouts)
    # The sidecar injection webhook; None: plain HTTP on loopback (embedding only).
    webhook: WebhookConfig | None = None
