"""What the API server would refuse in an object: built-in kinds against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict), our kinds against our CRDs, third-party
CRs for the fields their controllers cannot do without. Used by the manifest builds
here and by tests/injection (injected pods)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from kvquota.api.validation import validate_object

# The oldest Kubernetes we support; kubernetes-validate ships its schemas.
KUBERNETES_VERSION = "1.30"

# Third-party CRDs we do not ship: the fields without which the object does nothing.
THIRD_PARTY_REQUIRED: dict[tuple[str, str], list[str]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): ["spec.selector", "spec.podMetricsEndpoints"],
    ("monitoring.coreos.com/v1", "PrometheusRule"): ["spec.groups"],
    ("cert-manager.io/v1", "Issuer"): ["spec"],
    ("cert-manager.io/v1", "Certificate"): ["spec.secretName", "spec.dnsNames",
                                            "spec.issuerRef.name"],
    ("inference.networking.k8s.io/v1", "InferencePool"): [
        "spec.selector.matchLabels", "spec.targetPorts", "spec.endpointPickerRef.name",
        "spec.endpointPickerRef.port.number",
    ],
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ["spec.parentRefs", "spec.rules"],
    ("argoproj.io/v1alpha1", "Application"): [
        "spec.project", "spec.source.repoURL", "spec.source.path", "spec.destination.server",
    ],
}


def _get(obj: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None  # type: ignore[assignment]
    return obj


def schema_errors(obj: dict[str, Any]) -> list[str]:
    api_version, kind = obj["apiVersion"], obj["kind"]
    if api_version.startswith("kvquota.dev/"):
        return validate_object(obj)
    if (api_version, kind) in THIRD_PARTY_REQUIRED:
        return [
            f"{path}: Required value"
            for path in THIRD_PARTY_REQUIRED[(api_version, kind)] if not _get(obj, path)
        ]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {api_version} {kind}: add it to THIRD_PARTY_REQUIRED"]
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return [f"{where}: {exc.message}"]
    return []
