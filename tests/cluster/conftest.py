"""The cluster suite's fixtures: the real API server in KUBECONFIG, driven with kubectl.

Everything else under tests/ runs without a cluster; this suite proves what only a real
API server can (CRD admission, CEL cost limits, structural pruning, RBAC, server-side
apply ownership, webhooks, garbage collection). It runs only with
KVQUOTA_CLUSTER_TESTS=1 (`make cluster-test`); otherwise every test skips with one reason.

It installs as README says (`kubectl apply --server-side -k manifests/crds`, then
`-k manifests/base`, then pools and quotas), works in a namespace of its own per run
and removes what it created. The operator runs here as a local process under its own
ServiceAccount's token, never as cluster-admin. No Pod runs: the test plays the
kubelet only where it must. Against a server without the core APIs (a standalone
apiextensions-apiserver), what needs them skips and names what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

ENV = "KVQUOTA_CLUSTER_TESTS"
SKIP_REASON = (f"cluster suite: set {ENV}=1 to run it against the cluster in KUBECONFIG "
               "(make cluster-test)")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MANIFESTS = REPO / "manifests"
SYSTEM_NAMESPACE = "kvquota-system"  # manifests/base
SERVICE_ACCOUNT = "kvquota-operator"  # manifests/base/serviceaccount.yaml
OPERATOR_MANAGER = "kvquota-operator"  # the operator's field manager
FIELD_MANAGER = "kvquota-cluster-test"  # what this suite writes with (besides `kubectl`)
# The core APIs the operator and the webhook need; a standalone apiextensions-apiserver
# serves none of them.
CORE = ("namespaces", "configmaps", "events", "serviceaccounts",
        "clusterroles.rbac.authorization.k8s.io")
T = TypeVar("T")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(ENV) == "1":
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


# ------------------------------------------------------------------ kubectl


def dump(value: Any, limit: int = 4000) -> str:
    """What was observed, for a failure message (objects as YAML, trimmed)."""
    text = value if isinstance(value, str) else yaml.safe_dump(value, sort_keys=False)
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more)"


@dataclass(frozen=True)
class Kubectl:
    """kubectl against one kubeconfig; every call bounded by a timeout."""

    kubeconfig: str | None = None

    def run(self, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        if self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig
        try:
            proc = subprocess.run(["kubectl", *args], input=stdin, capture_output=True,
                                  text=True, timeout=timeout, env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"`kubectl {' '.join(args)}` took over {timeout:.0f} s; "
                                 f"output so far: {exc.stderr!r}") from None
        if check and proc.returncode:
            raise AssertionError(f"`kubectl {' '.join(args)}` exited {proc.returncode}:\n"
                                 f"{proc.stderr}{dump(proc.stdout)}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def get(self, resource: str, name: str, namespace: str | None = None) -> Any:
        """The object, or None when it does not exist."""
        scope = ["-n", namespace] if namespace else []
        out = self.run("get", resource, name, *scope, "-o", "json", "--ignore-not-found",
                       "--show-managed-fields").stdout
        return json.loads(out) if out.strip() else None

    def items(self, resource: str, namespace: str | None = None, *selector: str) -> list[Any]:
        scope = ["-n", namespace] if namespace else []
        return list(self.json("get", resource, *scope, *selector,
                              "--show-managed-fields")["items"])

    def apply(self, objects: list[dict[str, Any]] | str, *, manager: str = FIELD_MANAGER,
              dry_run: bool = False, force: bool = False, check: bool = True
              ) -> subprocess.CompletedProcess[str]:
        """Server-side apply of objects (or of a `-k` directory, given as a str path)."""
        args = ["apply", "--server-side", f"--field-manager={manager}"]
        args += ["--dry-run=server"] * dry_run + ["--force-conflicts"] * force
        if isinstance(objects, str):
            return self.run(*args, "-k", objects, check=check)
        return self.run(*args, "-f", "-", stdin=yaml.safe_dump_all(objects), check=check)

    def kustomize(self, path: Path) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(self.run("kustomize", str(path)).stdout)
                if doc]


def wait_for(fetch: Callable[[], T], done: Callable[[T], Any], what: str, *,
             timeout: float = 30, interval: float = 0.5) -> T:
    """Poll `fetch` until `done` holds for what it returns; on timeout fail with the last
    observation."""
    deadline = time.monotonic() + timeout
    while True:
        seen = fetch()
        if done(seen):
            return seen
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                 f"last observed:\n{dump(seen)}")
        time.sleep(interval)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return None


def in_namespace(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The objects moved into `namespace` (the samples and examples say `default`)."""
    moved = []
    for obj in objects:
        obj = json.loads(json.dumps(obj))
        if "namespace" in obj.get("metadata", {}):
            obj["metadata"]["namespace"] = namespace
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace
        moved.append(obj)
    return moved


# ------------------------------------------------------------------ objects

API_VERSION = "kvquota.dev/v1alpha1"


def pool(name: str, namespace: str) -> dict[str, Any]:
    """A small valid InferencePool (1,000 blocks per engine)."""
    return {
        "apiVersion": API_VERSION, "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"kvquota.dev/pool": name}}, "model": "tiny",
                 "kvCache": {"blockSize": 16, "capacityBlocks": 1000}},
    }


def quota(name: str, namespace: str, pool_name: str = "demo-pool") -> dict[str, Any]:
    """A small valid TenantQuota (10 guaranteed, 100 at most)."""
    return {
        "apiVersion": API_VERSION, "kind": "TenantQuota",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"poolRef": {"name": pool_name}, "tier": "standard",
                 "kvCache": {"guaranteedBlocks": 10, "maxBlocks": 100}},
    }


# ------------------------------------------------------------------ the cluster


@dataclass
class Cluster:
    kubectl: Kubectl
    kinds: dict[tuple[str, str], str] = field(default_factory=dict)  # (group, kind) -> name

    def discover(self) -> None:
        """What the server serves (after a CRD install, again)."""
        proc = self.kubectl.run("api-resources", "--no-headers=false", check=False)
        lines = proc.stdout.splitlines()
        if not lines:
            raise AssertionError(f"`kubectl api-resources` gave nothing:\n{proc.stderr}")
        header = lines[0]
        cols = [header.index(c) for c in ("NAME", "SHORTNAMES", "APIVERSION", "NAMESPACED",
                                          "KIND")]
        self.kinds = {}
        for line in lines[1:]:
            name, _, api_version, _, kind = (line[a:b].strip() for a, b in
                                             zip(cols, [*cols[1:], None], strict=True))
            group = api_version.rpartition("/")[0]
            self.kinds[(group, kind)] = f"{name}.{group}" if group else name

    def serves(self, resource: str) -> bool:
        return resource in self.kinds.values()

    def serves_kind(self, api_version: str, kind: str) -> bool:
        return (api_version.rpartition("/")[0], kind) in self.kinds

    def require(self, *resources: str) -> None:
        missing = [r for r in resources if not self.serves(r)]
        if missing:
            pytest.skip(f"this API server does not serve {', '.join(missing)} (a standalone "
                        "apiextensions-apiserver serves custom resources only)")

    def controller_manager(self) -> bool:
        """A kube-controller-manager holds its leader lease (renewed within a minute):
        garbage collection, ReplicaSets and namespace deletion happen."""
        if not self.serves("leases.coordination.k8s.io"):
            return False
        lease = self.kubectl.get("leases.coordination.k8s.io", "kube-controller-manager",
                                 "kube-system")
        renewed = ((lease or {}).get("spec") or {}).get("renewTime")
        if not renewed:
            return False
        age = datetime.now(UTC) - datetime.fromisoformat(renewed.replace("Z", "+00:00"))
        return age.total_seconds() < 60


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    kubectl = Kubectl()
    version = kubectl.run("version", "-o", "json", check=False)
    if version.returncode and "serverVersion" not in version.stdout:
        pytest.fail(f"no API server reachable with KUBECONFIG="
                    f"{os.environ.get('KUBECONFIG', '~/.kube/config')}:\n{version.stderr}")
    found = Cluster(kubectl)
    found.discover()
    return found


@pytest.fixture(scope="session")
def api(cluster: Cluster) -> Iterator[Cluster]:
    """The CRDs installed as README says: `kubectl apply --server-side -k manifests/crds`,
    each Established. Removed at the end if this run created them."""
    crds = [c["metadata"]["name"] for c in cluster.kubectl.kustomize(MANIFESTS / "crds")]
    existed = [n for n in crds if cluster.kubectl.get("crd", n)]
    try:
        cluster.kubectl.apply(str(MANIFESTS / "crds"), manager="kubectl")
        for name in crds:
            wait_for(lambda name=name: cluster.kubectl.get("crd", name),
                     lambda crd: (condition(crd, "Established") or {}).get("status") == "True",
                     f"CRD {name} Established")
        wait_for(lambda: (cluster.discover(), cluster)[1],
                 lambda c: c.serves("inferencepools.kvquota.dev") and c.serves(
                     "tenantquotas.kvquota.dev"), "the kvquota.dev API in discovery")
        # kubectl validates against the published OpenAPI, which trails Established by
        # a few seconds: an apply in between fails with "failed to download openapi".
        versions = {f"apis/{c['spec']['group']}/{v['name']}" for c in
                    cluster.kubectl.kustomize(MANIFESTS / "crds") for v in c["spec"]["versions"]}
        wait_for(lambda: set(json.loads(cluster.kubectl.run(
            "get", "--raw", "/openapi/v3").stdout)["paths"]),
            lambda paths: versions <= paths, f"OpenAPI v3 to publish {sorted(versions)}")
        yield cluster
    finally:
        created = [n for n in crds if n not in existed]
        if created:
            cluster.kubectl.run("delete", "crd", *created, "--ignore-not-found",
                                "--wait=false", check=False)


@pytest.fixture(scope="session")
def new_namespace(api: Cluster) -> Iterator[Callable[[str], str]]:
    """Namespaces of this run, `kvq-test-<run>-<purpose>` (created only where the server
    serves Namespaces); deleted at the end without waiting for their finalization."""
    run = uuid.uuid4().hex[:6]
    made: list[str] = []

    def make(purpose: str) -> str:
        name = f"kvq-test-{run}-{purpose}"
        if name in made:  # a function-scoped fixture asks again
            name = f"{name}-{len(made)}"
        if api.serves("namespaces"):
            api.kubectl.run("create", "namespace", name)
        made.append(name)
        return name

    yield make
    for name in made:
        if api.serves("namespaces"):
            api.kubectl.run("delete", "namespace", name, "--ignore-not-found", "--wait=false",
                            check=False)
        else:
            for kind in ("tenantquotas.kvquota.dev", "inferencepools.kvquota.dev"):
                api.kubectl.run("delete", kind, "--all", "-n", name, "--wait=false",
                                check=False)


@pytest.fixture(scope="session")
def namespace(new_namespace: Callable[[str], str]) -> str:
    """The namespace of the API-only tests (samples, examples, the invalid table)."""
    return new_namespace("api")


@pytest.fixture(scope="session")
def installed(api: Cluster) -> Iterator[Cluster]:
    """manifests/base applied as README says (after the CRDs). Removed at the end if this
    run created the operator's namespace."""
    api.require(*CORE, "mutatingwebhookconfigurations.admissionregistration.k8s.io",
                "deployments.apps")
    existed = api.kubectl.get("namespace", SYSTEM_NAMESPACE) is not None
    api.kubectl.apply(str(MANIFESTS / "base"), manager="kubectl")
    yield api
    if not existed:
        api.kubectl.run("delete", "-k", str(MANIFESTS / "base"), "--ignore-not-found",
                        "--wait=false", check=False)


@pytest.fixture(scope="session")
def operator_kubeconfig(installed: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig holding only the operator ServiceAccount's token: the operator runs
    with exactly the RBAC manifests/base grants it."""
    token = installed.kubectl.run("create", "token", SERVICE_ACCOUNT, "-n", SYSTEM_NAMESPACE,
                                  "--duration=2h").stdout.strip()
    current = installed.kubectl.json("config", "view", "--raw", "--minify", "--flatten")
    server = current["clusters"][0]
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": server["cluster"]}],
        "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": SERVICE_ACCOUNT, "context": {
            "cluster": "cluster", "user": SERVICE_ACCOUNT}}],
        "current-context": SERVICE_ACCOUNT,
    }
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    whoami = Kubectl(str(path)).run("auth", "can-i", "create", "clusterrolebindings",
                                    check=False)
    assert whoami.stdout.strip() == "no", "the operator's token must not be cluster-admin"
    return path


# ------------------------------------------------------------------ the operator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def deployed_flags() -> list[str]:
    """The flags manifests/operator runs `kvquota operator` with, less the listen
    addresses and the priority a local process sets itself."""
    deployment = yaml.safe_load((MANIFESTS / "operator" / "deployment.yaml").read_text())
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["kvquota", "operator"], command
    flags, rest = [], iter(command[2:])
    for flag in rest:
        if flag in ("--priority", "--liveness", "--metrics"):
            next(rest)
        else:
            flags.append(flag)
    return flags


@dataclass
class Operator:
    """`kvquota operator` as a local process with the ServiceAccount's kubeconfig."""

    name: str
    args: list[str]
    kubeconfig: Path
    log: Path
    health_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Operator:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(KUBECONFIG=str(self.kubeconfig), POD_ID=self.name, PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "kvquota.cli", "operator", *self.args,
                   "--liveness", f"http://127.0.0.1:{self.health_port}/healthz"]
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(command)}\n".encode())
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO)
        return self

    def health(self) -> dict[str, Any] | None:
        """kopf's liveness answer (probe results), once it serves one."""
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as response:
                return dict(json.loads(response.read() or b"{}"))
        except (OSError, ValueError):
            return None

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(lambda: (self.running(), self.health()), lambda seen: seen[1] is not None
                 or not seen[0], f"operator {self.name} to serve its liveness probe",
                 timeout=timeout)
        assert self.running(), f"operator {self.name} exited:\n{self.output()}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-tail:]

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, as the kubelet sends: kopf leaves its peering on the way out."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"operator {self.name} ignored SIGTERM for {timeout:.0f} s:\n"
                                 f"{self.output()}") from None


@pytest.fixture
def run_operator(operator_kubeconfig: Path, tmp_path: Path
                 ) -> Iterator[Callable[..., Operator]]:
    """Start `kvquota operator NAME FLAGS...` processes; all are stopped at the end.
    Without flags it runs with the Deployment's (cluster-wide, --require-peering)."""
    started: list[Operator] = []

    def start(name: str, *flags: str, priority: int = 300) -> Operator:
        args = [*(flags or deployed_flags()), "--priority", str(priority)]
        if "--webhook-listen" not in flags:
            args += ["--webhook-listen", f"127.0.0.1:{free_port()}"]
        operator = Operator(name, args, operator_kubeconfig, tmp_path / f"{name}.log")
        started.append(operator.start())
        operator.wait_ready()
        return operator

    yield start
    for operator in started:
        with contextlib.suppress(AssertionError):
            operator.stop()
    for operator in started:
        # kopf's APIForbiddenError, the client's "Reason: Forbidden", the server's
        # "... is forbidden: User ..." (not a 403-byte access-log line).
        forbidden = [line for line in operator.output(10**6).splitlines()
                     if "forbidden" in line.lower()]
        assert not forbidden, f"operator {operator.name} was refused by RBAC:\n" + "\n".join(
            forbidden[:20])
