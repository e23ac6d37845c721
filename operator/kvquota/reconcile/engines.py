"""Find a pool's engine pods and poll each ready one's sidecar status endpoint.

Ready engines are pods matched by the pool's selector with the Ready condition
(Kubernetes readiness, the same signal a Service uses): that count is what quotas are
split over, so a flaky status poll never changes the policy. The sidecar reports
(`SidecarStatus` at `GET /kvquota/status` on the sidecar's admin port, never the client
port) feed capacity, usage and sync.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from engine_sidecar.contract.names import ADMIN_PORT, ADMIN_PORT_NAME, GROUP, STATUS_ROUTE
from engine_sidecar.contract.stats import SidecarStatus
from kvquota.api import LabelSelector
from kvquota.reconcile.usage import EngineObservation

if TYPE_CHECKING:
    import httpx

    from kvquota.reconcile.kube import KubeApi

PORT_ANNOTATION = f"{GROUP}/status-port"
SIDECAR_CONTAINER = "kvquota-sidecar"


def selector_string(selector: LabelSelector) -> str:
    """The `labelSelector` query parameter for a list call."""
    parts = [f"{k}={v}" for k, v in sorted(selector.match_labels.items())]
    for req in selector.match_expressions:
        if req.operator == "Exists":
            parts.append(req.key)
        elif req.operator == "DoesNotExist":
            parts.append(f"!{req.key}")
        else:
            op = "in" if req.operator == "In" else "notin"
            parts.append(f"{req.key} {op} ({','.join(req.values)})")
    return ",".join(parts)


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Client-side check, so a server that ignores `labelSelector` cannot widen a pool."""
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    for req in selector.match_expressions:
        present = req.key in labels
        ok = {
            "In": present and labels.get(req.key) in req.values,
            "NotIn": not present or labels.get(req.key) not in req.values,
            "Exists": present,
            "DoesNotExist": not present,
        }[req.operator]
        if not ok:
            return False
    return True


def gateway_selector(gateway_pool: Mapping[str, Any]) -> LabelSelector | None:
    """The engine selector of a Gateway API InferencePool: `spec.selector.matchLabels`
    (v1) or the flat label map of v1alpha2."""
    raw = (gateway_pool.get("spec") or {}).get("selector") or {}
    labels = raw.get("matchLabels") if isinstance(raw.get("matchLabels"), dict) else raw
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        return None
    return LabelSelector(match_labels=dict(labels))


def is_ready(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def status_url(pod: Mapping[str, Any]) -> str:
    """The sidecar's admin port: the annotation, else its container port named `admin`,
    else the default."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    port: int | str = (meta.get("annotations") or {}).get(PORT_ANNOTATION) or 0
    if not port:
        for container in spec.get("containers") or ():
            if container.get("name") == SIDECAR_CONTAINER:
                for item in container.get("ports") or ():
                    if item.get("name") == ADMIN_PORT_NAME:
                        port = item.get("containerPort") or 0
    ip = str((pod.get("status") or {}).get("podIP"))
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{int(port) or ADMIN_PORT}{STATUS_ROUTE}"


class EnginePoller:
    """Lists a pool's pods and polls their sidecars concurrently, each poll bounded."""

    def __init__(self, kube: KubeApi, http: httpx.AsyncClient, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = kube
        self._http = http
        self._timeout = timeout
        self._clock = clock  # stamps observations for the disruption window

    async def _fetch(self, pod: Mapping[str, Any]) -> SidecarStatus | str:
        url = status_url(pod)
        try:
            response = await self._http.get(url, timeout=self._timeout)
            response.raise_for_status()
            return SidecarStatus.model_validate_json(response.content)
        except ValidationError:
            return "status endpoint answered with an unexpected body"
        except Exception as error:  # any transport or HTTP error: report, never raise
            return f"status endpoint unreachable ({type(error).__name__})"

    async def observe(self, namespace: str, selector: LabelSelector) -> EngineObservation:
        pods = await self._kube.list_pods(namespace, selector_string(selector))
        matched = [
            p for p in pods if selector_matches(selector, p["metadata"].get("labels") or {})
        ]
        ready = sorted(filter(is_ready, matched), key=lambda p: p["metadata"]["name"])
        results = await asyncio.gather(*(self._fetch(p) for p in ready))
        reports: dict[str, SidecarStatus] = {}
        errors: dict[str, str] = {}
        for pod, result in zip(ready, results, strict=True):
            name = pod["metadata"]["name"]
            if isinstance(result, str):
                errors[name] = result
            else:
                reports[name] = result
                if result.policy_error:
                    errors[name] = f"policy refused: {result.policy_error}"
        return EngineObservation(
            matched=len(matched),
            ready=tuple(p["metadata"]["name"] for p in ready),
            reports=reports,
            errors=errors,
            observed_at=self._clock(),
        )
