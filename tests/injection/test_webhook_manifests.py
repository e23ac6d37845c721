"""The webhook as installed (manifests/base, overlays/cert-manager): what it is called
for, what it can block, and that its pieces point at each other."""

from __future__ import annotations

from typing import Any

from manifests.conftest import build, one

from kvquota.inject.certs import service_names
from kvquota.inject.webhook import CONFIGURATION, HANDLER_ID, WEBHOOK_NAME


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's matchExpressions, as the API server evaluates them."""
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if ((op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels)
                or (op == "In" and labels.get(key) not in values)
                or (op == "NotIn" and key in labels and labels[key] in values)):
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _webhook(objects: list[dict[str, Any]]) -> dict[str, Any]:
    configuration = one(objects, "MutatingWebhookConfiguration", CONFIGURATION)
    (webhook,) = configuration["webhooks"]
    assert webhook["name"] == WEBHOOK_NAME
    return dict(webhook)


def _called_for(webhook: dict[str, Any], namespace: str, labels: dict[str, str]) -> bool:
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    return (_matches(webhook["objectSelector"], labels)
            and _matches(webhook["namespaceSelector"], ns_labels))


def test_a_down_operator_never_blocks_unrelated_pods() -> None:
    webhook = _webhook(build("manifests/base"))
    pool = {"kvquota.dev/pool": "demo-pool"}
    assert _called_for(webhook, "default", pool)
    assert not _called_for(webhook, "default", {"app": "web"})  # no pool label
    assert not _called_for(webhook, "kube-system", pool)
    assert not _called_for(webhook, "kvquota-system", pool)  # the operator itself
    assert not _called_for(webhook, "default", {**pool, "kvquota.dev/injection": "disabled"})
    # Labelled pods wait for the operator rather than start without the sidecar.
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""],
                                 "apiVersions": ["v1"], "resources": ["pods"],
                                 "scope": "Namespaced"}]
    assert webhook["sideEffects"] == "None" and webhook["timeoutSeconds"] <= 10


def test_the_api_server_reaches_the_operators_webhook_port() -> None:
    objects = build("manifests/base")
    webhook = _webhook(objects)
    service_ref = webhook["clientConfig"]["service"]
    assert service_ref["path"] == f"/{HANDLER_ID}"  # kopf serves the handler there
    service = one(objects, "Service", service_ref["name"])
    assert service["metadata"]["namespace"] == service_ref["namespace"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == service_ref["port"]]
    operator = one(objects, "Deployment", "kvquota-operator")
    pod = operator["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == 9443  # `kvquota operator --webhook-listen` default
    # The self-signed certificate names what the API server dials.
    assert f"{service_ref['name']}.{service_ref['namespace']}.svc" in service_names(
        "kvquota-webhook", "kvquota-system")


def test_the_operator_may_publish_its_ca_in_its_own_webhook_configuration_only() -> None:
    role = one(build("manifests/base"), "ClusterRole", "kvquota-operator")
    rules = [r for r in role["rules"]
             if "mutatingwebhookconfigurations" in r.get("resources", [])]
    assert rules == [{"apiGroups": ["admissionregistration.k8s.io"],
                      "resources": ["mutatingwebhookconfigurations"],
                      "resourceNames": [CONFIGURATION], "verbs": ["get", "patch"]}]


def test_with_cert_manager_the_operator_serves_the_certificate_it_issues() -> None:
    objects = build("manifests/overlays/cert-manager")
    certificate = one(objects, "Certificate", "kvquota-webhook")
    service_ref = _webhook(objects)["clientConfig"]["service"]
    assert f"{service_ref['name']}.{service_ref['namespace']}.svc" in (
        certificate["spec"]["dnsNames"])
    configuration = one(objects, "MutatingWebhookConfiguration", CONFIGURATION)
    namespace = certificate["metadata"]["namespace"]
    assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{namespace}/{certificate['metadata']['name']}")
    pod = one(objects, "Deployment", "kvquota-operator")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    flag = next(a for a in container["command"] if a.startswith("--webhook-cert-dir="))
    cert_dir = flag.split("=", 1)[1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == cert_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
