"""What injection adds to a pod spec, as one pure function of the spec.

The sidecar takes over vLLM's client port (so Services, routers and scrapers reach
it) and vLLM moves to a loopback port; probes keep working; vLLM's API key goes to the
sidecar (`engine_key`); two init containers copy the plugin and check it in vLLM's own
image; flags the plugin needs are added and conflicting ones replaced (recorded in
`kvquota.dev/replaced`). A pod already injected comes back unchanged. The rules in
full: docs/operator.md, "What injection does to a pod".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from engine_sidecar.contract.names import (
    ADMIN_PORT,
    ADMIN_PORT_NAME,
    ENGINE_NAME_ENV,
    ENGINE_NAMESPACE_ENV,
    GROUP,
    PLUGIN_CLASS,
    POLICY_CONFIGMAP_SUFFIX,
    POLICY_FILE,
    POLICY_PATH_ENV,
    POOL_LABEL,
    PREFLIGHT_MODULE,
    PREFLIGHT_STRICT_FLAG,
    STATS_FILE,
    STATS_PATH_ENV,
)
from kvquota import __version__
from kvquota.inject.engine_key import KeyRefused, engine_key_env
from kvquota.inject.vllm_argv import (
    DEFAULT_PORT,
    NotVllm,
    VllmCommand,
    unwrap_shell,
)

ENGINE_LABEL = f"{GROUP}/engine"
INJECTED_ANNOTATION = f"{GROUP}/injected"
REPLACED_ANNOTATION = f"{GROUP}/replaced"
STATUS_PORT_ANNOTATION = f"{GROUP}/status-port"  # what kvquota.reconcile.engines polls
OPT_OUT_LABEL = f"{GROUP}/injection"  # "disabled": left alone (as the webhook's selectors)
SIDECAR = "kvquota-sidecar"
INIT = "kvquota-install-plugin"
CHECK = "kvquota-check-plugin"  # the pre-flight check, in the engine's image
PLUGIN_DIR = "/opt/kvquota/python"
RUN_DIR = "/var/run/kvquota"
SECRETS_DIR = "/etc/kvquota/secrets"
STORE_SECRETS_DIR = "/etc/kvquota/pool-store"  # the pool store's password, its own Secret
STORE_VOLUME = "kvquota-pool-store"
# Paths the sidecar forwards without credentials (engine_sidecar.gateway.relay.passthrough).
PROBE_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
ENGINE_PORT = 8001  # vLLM's loopback port, or the next free one
_RESTRICTED = {
    "runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


class InjectionRefused(ValueError):
    """The pod cannot be injected; the message says why and what to change."""


@dataclass(frozen=True)
class InjectionOptions:
    image: str = f"ghcr.io/kvquota/sidecar:v{__version__}"  # this release's
    secret: str = "kvquota-auth"  # the Secret the pool's spec.auth names
    # The Secret spec.poolStore.passwordSecretRef names; optional, so pools without a
    # store (or whose store has no password) need none.
    store_secret: str = "kvquota-pool-store"
    service_account: str = "kvquota-engine"  # set when the pod names none


@dataclass(frozen=True)
class Injected:
    spec: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str]
    changed: bool


def inject_pod(
    metadata: dict[str, Any], spec: dict[str, Any], pool: str | None = None,
    options: InjectionOptions | None = None, served_model_name: str | None = None,
) -> Injected:
    """The injected pod (metadata labels/annotations and spec; inputs are not changed).

    `pool` defaults to the pod's `kvquota.dev/pool` label. `served_model_name`: the
    pool's `spec.model`, which vLLM is told to serve (`--served-model-name`) unless the
    pod names its own, so responses carry the name clients ask for, not a model
    directory. Raises `InjectionRefused`.
    """
    options = options or InjectionOptions()
    labels = dict(metadata.get("labels") or {})
    annotations = dict(metadata.get("annotations") or {})
    if labels.get(OPT_OUT_LABEL) == "disabled":
        return Injected(copy.deepcopy(spec), labels, annotations, changed=False)
    pool = pool or labels.get(POOL_LABEL)
    if not pool:
        raise InjectionRefused(f"it has no {POOL_LABEL} label naming its InferencePool")
    spec = copy.deepcopy(spec)
    containers: list[dict[str, Any]] = spec.get("containers") or []
    if any(c.get("name") == SIDECAR for c in containers):
        return Injected(spec, labels, annotations, changed=False)
    vllm, command, unwrapped = _vllm_container(containers)
    if command.find("scheduler-cls"):
        raise InjectionRefused(
            f"container {vllm['name']!r} already sets --scheduler-cls "
            f"({command.find('scheduler-cls')[0].value}); KVQuota's scheduler "
            f"({PLUGIN_CLASS}) would replace it: remove the flag to use KVQuota")
    if command.find("ssl-certfile") or command.find("uds"):
        raise InjectionRefused(
            f"container {vllm['name']!r} serves TLS or a Unix socket (--ssl-certfile/--uds); "
            "the sidecar terminates client connections and reaches vLLM over loopback HTTP")

    used = _used_ports(spec)
    serve_port = _port_flag(command)
    engine_port = _free(used | {serve_port}, ENGINE_PORT)
    admin_port = _free(used | {serve_port, engine_port}, ADMIN_PORT)  # or the next free
    replaced = [unwrapped] if unwrapped else []
    replaced += _edit_flags(command, engine_port)
    if served_model_name and not command.find("served-model-name"):
        command.append(f"--served-model-name={served_model_name}")
    command.write_back()

    moved = _take_port(vllm, serve_port)
    replaced += _retarget_probes(vllm, serve_port, moved)
    _add_plugin_env(vllm)
    sidecar = _sidecar(options, serve_port, engine_port, admin_port, moved)
    try:  # vLLM's own API key, sent upstream by the sidecar (`engine_key`)
        sidecar["env"].extend(engine_key_env(vllm, command,
                                             {e["name"] for e in sidecar["env"]}))
    except KeyRefused as exc:
        raise InjectionRefused(f"container {vllm['name']!r}: {exc}") from None
    containers.append(sidecar)
    spec.setdefault("initContainers", []).extend(
        [_init_container(options), _check_container(vllm, command.python())])
    spec.setdefault("volumes", []).extend(_volumes(options))
    if spec.get("serviceAccountName") in (None, "", "default"):
        spec["serviceAccountName"] = options.service_account

    labels[POOL_LABEL] = pool
    labels[ENGINE_LABEL] = "true"
    annotations[INJECTED_ANNOTATION] = options.image
    annotations[STATUS_PORT_ANNOTATION] = str(admin_port)
    if not any(key.startswith("prometheus.io/") for key in annotations):
        # For a Prometheus that scrapes annotated pods; a pod that already names a port
        # (KServe: vLLM's metrics) keeps it, and the sidecar forwards vLLM's /metrics.
        annotations.update({"prometheus.io/scrape": "true",
                            "prometheus.io/port": str(admin_port),
                            "prometheus.io/path": "/metrics"})
    if replaced:
        annotations[REPLACED_ANNOTATION] = "; ".join(replaced)
    return Injected(spec, labels, annotations, changed=True)


def _vllm_container(
    containers: list[dict[str, Any]],
) -> tuple[dict[str, Any], VllmCommand, str | None]:
    found: list[tuple[dict[str, Any], VllmCommand, str | None]] = []
    reasons: list[str] = []
    for container in containers:
        try:
            unwrapped = unwrap_shell(container)
            found.append((container, VllmCommand.parse(container), unwrapped))
        except NotVllm as exc:
            reasons.append(f"{container.get('name')!r}: {exc}")
    if not found:
        raise InjectionRefused("no container runs vLLM's OpenAI server (" + "; ".join(reasons)
                               + ")" if reasons else "it has no containers")
    if len(found) > 1:
        names = ", ".join(repr(c.get("name")) for c, _, _ in found)
        raise InjectionRefused(f"several containers run vLLM ({names}); KVQuota puts one "
                               "sidecar in front of one vLLM server per pod")
    return found[0]


def _port_flag(command: VllmCommand) -> int:
    ports = command.find("port")
    value = ports[-1].value if ports else None  # argparse: the last one wins
    if value is None:
        return DEFAULT_PORT
    try:
        return int(value)
    except ValueError:
        raise InjectionRefused(f"vLLM's --port is {value!r}, not a number") from None


def _edit_flags(command: VllmCommand, engine_port: int) -> list[str]:
    """Set every flag the plugin needs exactly once; the replacements, for the record."""
    replaced: list[str] = []
    for flag in command.find("scheduling-policy"):
        if flag.value != "priority":
            replaced.append(f"--scheduling-policy {flag.value} -> priority")
            command.set_value(flag, "priority")
    if not command.find("scheduling-policy"):
        command.append("--scheduling-policy=priority")
    for flag in command.find("no-enable-prefix-caching"):
        replaced.append("--no-enable-prefix-caching -> --enable-prefix-caching (leases "
                        "pin prefix-cached blocks)")
        command.replace_token(flag.at, "--enable-prefix-caching")
    if not command.find("enable-prefix-caching"):
        command.append("--enable-prefix-caching")
    for name, value in (("port", str(engine_port)), ("host", "127.0.0.1")):
        flags = command.find(name)
        for flag in flags:
            command.set_value(flag, value)
        if not flags:
            command.append(f"--{name}={value}")
    if not command.find("enable-prompt-tokens-details"):
        command.append("--enable-prompt-tokens-details")
    command.append(f"--scheduler-cls={PLUGIN_CLASS}")
    return replaced


def _used_ports(spec: dict[str, Any]) -> set[int]:
    return {int(p["containerPort"])
            for c in [*spec.get("containers", []), *spec.get("initContainers", [])]
            for p in c.get("ports") or [] if "containerPort" in p}


def _free(used: set[int], start: int) -> int:
    port = start
    while port in used:
        port += 1
    return port


def _take_port(vllm: dict[str, Any], serve_port: int) -> dict[str, Any]:
    """Remove vLLM's serving port entry; the sidecar declares it (its name kept)."""
    ports = vllm.get("ports") or []
    mine = [p for p in ports if int(p.get("containerPort", -1)) == serve_port]
    if mine:
        vllm["ports"] = [p for p in ports if p not in mine]
        if not vllm["ports"]:
            del vllm["ports"]
        return {**mine[0], "name": mine[0].get("name", "http")}
    return {"name": "http", "containerPort": serve_port, "protocol": "TCP"}


def _retarget_probes(vllm: dict[str, Any], serve_port: int, moved: dict[str, Any]) -> list[str]:
    """Probes on the serving port now reach the sidecar: by number (a named port must be
    the probing container's own), on a path it forwards without credentials."""
    notes: list[str] = []
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = vllm.get(kind)
        if not probe:
            continue
        handler = probe.get("httpGet") or probe.get("tcpSocket")
        if handler is None or handler.get("port") not in (serve_port, str(serve_port),
                                                          moved.get("name")):
            continue
        handler["port"] = serve_port
        if "httpGet" in probe and probe["httpGet"].get("path", "/") not in PROBE_PATHS:
            notes.append(f"{kind} {probe['httpGet'].get('path', '/')} -> /health (the "
                         "sidecar asks for a tenant's token there)")
            probe["httpGet"]["path"] = "/health"
    return notes


def _add_plugin_env(vllm: dict[str, Any]) -> None:
    env: list[dict[str, Any]] = vllm.setdefault("env", [])
    by_name = {e.get("name"): e for e in env}
    current = by_name.get("PYTHONPATH")
    if current is None:
        env.append({"name": "PYTHONPATH", "value": PLUGIN_DIR})
    elif "value" in current:
        current["value"] = f"{PLUGIN_DIR}:{current['value']}" if current["value"] else PLUGIN_DIR
    else:
        raise InjectionRefused(f"container {vllm['name']!r} takes PYTHONPATH from a "
                               "reference; the plugin must be prepended to it")
    for name, value in ((POLICY_PATH_ENV, f"{RUN_DIR}/{POLICY_FILE}"),
                        (STATS_PATH_ENV, f"{RUN_DIR}/{STATS_FILE}")):
        if name in by_name:
            by_name[name].clear()
            by_name[name].update(name=name, value=value)
        else:
            env.append({"name": name, "value": value})
    if ENGINE_NAME_ENV not in by_name:  # the plugin picks its pod's per-engine split
        env.append({"name": ENGINE_NAME_ENV, "valueFrom": _field("metadata.name")})
    mounts: list[dict[str, Any]] = vllm.setdefault("volumeMounts", [])
    mounts.append({"name": "kvquota-python", "mountPath": PLUGIN_DIR, "readOnly": True})
    mounts.append({"name": "kvquota-run", "mountPath": RUN_DIR})


def _field(path: str) -> dict[str, Any]:
    # `apiVersion` is what the API server would default: a fieldRef is an atomic struct
    # under server-side apply, so one without it differs from the stored pod and a
    # second applier of the same manifest conflicts with the first.
    return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}


def _sidecar(options: InjectionOptions, serve_port: int, engine_port: int,
             admin_port: int, client_port: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": SIDECAR,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvquota", "sidecar",
            "--listen", f"0.0.0.0:{serve_port}",
            "--admin-listen", f"$(POD_IP):{admin_port}",
            "--upstream", f"http://127.0.0.1:{engine_port}",
            "--policy-configmap", f"$(POD_NAMESPACE)/$(KVQUOTA_POOL){POLICY_CONFIGMAP_SUFFIX}",
            "--secrets-dir", SECRETS_DIR,
            "--pool-store-secrets-dir", STORE_SECRETS_DIR,
        ],
        "env": [
            {"name": ENGINE_NAMESPACE_ENV, "valueFrom": _field("metadata.namespace")},
            {"name": "POD_IP", "valueFrom": _field("status.podIP")},
            {"name": ENGINE_NAME_ENV, "valueFrom": _field("metadata.name")},
            # The pool this engine serves: its label (set above to `pool`).
            {"name": "KVQUOTA_POOL",
             "valueFrom": _field(f"metadata.labels['{POOL_LABEL}']")},
            {"name": POLICY_PATH_ENV, "value": f"{RUN_DIR}/{POLICY_FILE}"},
            {"name": STATS_PATH_ENV, "value": f"{RUN_DIR}/{STATS_FILE}"},
        ],
        "ports": [client_port, {"name": ADMIN_PORT_NAME, "containerPort": admin_port,
                                "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": ADMIN_PORT_NAME},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": ADMIN_PORT_NAME},
                          "initialDelaySeconds": 10, "periodSeconds": 15,
                          "timeoutSeconds": 5, "failureThreshold": 4},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": copy.deepcopy(_RESTRICTED),
        "volumeMounts": [
            {"name": "kvquota-run", "mountPath": RUN_DIR},
            {"name": "kvquota-secrets", "mountPath": SECRETS_DIR, "readOnly": True},
            {"name": STORE_VOLUME, "mountPath": STORE_SECRETS_DIR, "readOnly": True},
            {"name": "kvquota-tmp", "mountPath": "/tmp"},
        ],
    }


def _init_container(options: InjectionOptions) -> dict[str, Any]:
    return {
        "name": INIT,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kvquota", "install-plugin", PLUGIN_DIR],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                      "limits": {"memory": "128Mi"}},
        "securityContext": copy.deepcopy(_RESTRICTED),
        "volumeMounts": [{"name": "kvquota-python", "mountPath": PLUGIN_DIR}],
    }


def _check_container(vllm: dict[str, Any], python: str) -> dict[str, Any]:
    """The pre-flight check (`engine_sidecar.plugin.preflight`) on the copied plugin, in the
    vLLM container's own image and environment (its PYTHONPATH already starts with the
    plugin): the vLLM that will run is the one checked. A vLLM the plugin does not run
    on, or would refuse to start on, fails the pod at init with the check's message
    (its log is the termination message) instead of crash-looping the engine."""
    check: dict[str, Any] = {
        "name": CHECK,
        "image": vllm["image"],
        "command": [python, "-m", PREFLIGHT_MODULE, PREFLIGHT_STRICT_FLAG],
        "workingDir": PLUGIN_DIR,  # `-m` puts it first on sys.path: the copied plugin
        # The engine's environment (its variables may change what vLLM does), with a
        # writable home: vLLM caches what it learns of models under ~/.cache.
        "env": [*(e for e in copy.deepcopy(vllm.get("env") or []) if e.get("name") != "HOME"),
                {"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "250m", "memory": "1Gi"},
                      "limits": {"memory": "2Gi"}},
        "securityContext": copy.deepcopy(_RESTRICTED),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "kvquota-python", "mountPath": PLUGIN_DIR, "readOnly": True},
                         {"name": "kvquota-tmp", "mountPath": "/tmp"}],
    }
    if vllm.get("envFrom"):
        check["envFrom"] = copy.deepcopy(vllm["envFrom"])
    if vllm.get("imagePullPolicy"):
        check["imagePullPolicy"] = vllm["imagePullPolicy"]
    return check


def _volumes(options: InjectionOptions) -> list[dict[str, Any]]:
    return [
        {"name": "kvquota-python", "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": "kvquota-run", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
        {"name": "kvquota-secrets", "secret": {"secretName": options.secret,
                                                "defaultMode": 0o444}},
        {"name": STORE_VOLUME, "secret": {"secretName": options.store_secret,
                                                   "defaultMode": 0o444, "optional": True}},
        {"name": "kvquota-tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
