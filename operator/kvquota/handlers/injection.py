"""The sidecar injection webhook: pods labelled `kvquota.dev/pool` get the sidecar.

Thin: `kvquota.inject` does the work (the same code as `kvquota inject`). A pod that
cannot be injected is refused with the reason; kopf answers the AdmissionReview with
the JSON patch from the pod as admitted to the pod as injected.
"""

# kopf types callbacks as protocols naming every kwarg; ours name only what they use.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import copy
from typing import Any

import kopf

from kvquota.inject.objects import inject_object
from kvquota.inject.pod import POOL_LABEL, REPLACED_ANNOTATION, InjectionRefused
from kvquota.inject.webhook import HANDLER_ID, WebhookConfig, configure_admission
from kvquota.metrics import record_webhook_call


@kopf.on.startup()
async def serve_webhook(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = memo.get("config")
    webhook: WebhookConfig | None = getattr(config, "webhook", None)
    memo.webhook = configure_admission(settings, webhook, getattr(config, "api_server", None))


@kopf.on.mutate("v1", "pods", id=HANDLER_ID, operations=["CREATE"], persistent=True,
                labels={POOL_LABEL: kopf.PRESENT})
def inject_sidecar(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, warnings: list[str],
                   logger: kopf.Logger, inferencepools_by_key: kopf.Index[Any, Any],
                   namespace: str | None = None, **_: Any) -> None:
    server = memo.get("webhook")
    options = server.config.options if server is not None else None
    pod = copy.deepcopy(dict(body))
    try:
        injected = inject_object(pod, options=options, served_model_name=_pool_model(
            pod, namespace, inferencepools_by_key))
    except InjectionRefused as exc:
        logger.warning("%s", exc)
        record_webhook_call("Pod", "CREATE", "denied")
        raise kopf.AdmissionError(str(exc), code=400) from None
    except Exception:
        record_webhook_call("Pod", "CREATE", "error")
        raise
    record_webhook_call("Pod", "CREATE", "allowed")
    if injected is pod:
        return  # already injected: nothing to change
    replaced = injected["metadata"]["annotations"].get(REPLACED_ANNOTATION)
    if replaced:
        warnings.append(f"KVQuota replaced: {replaced}")

    def become_injected(raw: dict[str, Any]) -> None:
        raw.clear()
        raw.update(copy.deepcopy(injected))

    patch.fns.append(become_injected)


def _pool_model(pod: dict[str, Any], namespace: str | None,
                pools: kopf.Index[Any, Any]) -> str | None:
    """The `spec.model` of the pool the pod names, if the operator knows the pool (a pod
    created before its pool is injected without it and keeps vLLM's own name)."""
    meta = pod.get("metadata") or {}
    key = (meta.get("namespace") or namespace, (meta.get("labels") or {}).get(POOL_LABEL))
    for pool in pools.get(key, ()):
        model = ((pool or {}).get("spec") or {}).get("model")
        if isinstance(model, str) and model:
            return model
    return None
