"""`kvquota sidecar` (the admission gateway) and `kvquota install-plugin` (initContainer).

Heavy imports (starlette, uvicorn, httpx, transformers) stay inside the commands so
`kvquota --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_sidecar.contract.listen import parse_listen
from engine_sidecar.contract.names import (
    ADMIN_PORT,
    ENGINE_KEY_ENV,
    ENGINE_KEY_FILE_ENV,
    ENGINE_NAME_ENV,
    POLICY_PATH_ENV,
    STATS_PATH_ENV,
    STATUS_ROUTE,
)
from engine_sidecar.gateway.auth.engine_key import load_engine_key
from engine_sidecar.gateway.intake.body import BODY_BYTES_PER_TOKEN
from engine_sidecar.plugin import preflight

if TYPE_CHECKING:
    from engine_sidecar.gateway.app import Gateway

PACKAGE_DIR = Path(__file__).resolve().parent
# What runs inside vLLM, and all install-plugin copies: not the gateway, not this CLI.
# The top-level modules are the paths 0.1.0's manifests name (contract/renamed.py).
PLUGIN_PARTS = ("__init__.py", "contract", "plugin", "scheduler.py", "preflight.py",
                "policy.py")


def register(subparsers: Any) -> None:
    sidecar = subparsers.add_parser(
        "sidecar",
        help="run the admission sidecar in front of a vLLM OpenAI server",
        description=(
            "OpenAI-compatible admission gateway: verifies tenants, clamps max_tokens, "
            "reserves KV blocks (429 over quota, 503 under the watermark), tags requests "
            "for the scheduler plugin and streams them to vLLM. The active policy is "
            f"written to ${POLICY_PATH_ENV} for the plugin; live KV stats are read from "
            f"${STATS_PATH_ENV}."
        ),
    )
    sidecar.add_argument("--listen", default="0.0.0.0:8000", metavar="HOST:PORT",
                         help="address clients reach: /v1/*, /healthz, /readyz "
                              "(default: %(default)s)")
    sidecar.add_argument("--admin-listen", default=f"0.0.0.0:{ADMIN_PORT}",
                         metavar="HOST:PORT",
                         help=f"address for the operator, Prometheus and probes: "
                              f"{STATUS_ROUTE}, /metrics, /healthz, /readyz with reasons "
                              "(default: %(default)s; in a pod, bind the pod IP)")
    sidecar.add_argument("--upstream", default="http://127.0.0.1:8001", metavar="URL",
                         help="the vLLM OpenAI server (default: %(default)s)")
    sidecar.add_argument("--engine-api-key-file", type=Path, metavar="PATH",
                         help="file holding vLLM's API key (its --api-key), sent to vLLM "
                              "instead of the client's credentials (default: "
                              f"${ENGINE_KEY_FILE_ENV}, else ${ENGINE_KEY_ENV}; none: no key)")
    source = sidecar.add_mutually_exclusive_group(required=True)
    source.add_argument("--policy-file", type=Path, metavar="PATH",
                        help="poll this EnginePolicy JSON file")
    source.add_argument("--policy-configmap", metavar="NAMESPACE/NAME",
                        help="watch this ConfigMap's policy.json (in-cluster credentials)")
    sidecar.add_argument("--secrets-dir", type=Path, metavar="DIR",
                         help="mounted Secret: the JWT key file named by the policy and the "
                              "'cache-salt' pool secret")
    sidecar.add_argument("--pool-store-secrets-dir", type=Path, metavar="DIR",
                         help="mounted Secret holding the pool store's password (the key "
                              "spec.poolStore.passwordSecretRef names), looked for here "
                              "first, then in --secrets-dir")
    counting = sidecar.add_mutually_exclusive_group()
    counting.add_argument("--tokenizer", metavar="PATH_OR_NAME",
                          help="tokenizer counting completion prompts, loaded at start (one "
                               "that cannot be loaded stops the sidecar); default: the "
                               "engine's model, then the policy's, and not ready if neither "
                               "loads. Chat prompts are always counted by the engine's "
                               "/tokenize")
    counting.add_argument("--engine-tokenizer", action="store_true",
                          help="count every prompt with the engine's /tokenize endpoint "
                               "(one round trip per request; no local tokenizer)")
    sidecar.add_argument("--tokenizer-workers", type=int, default=1, metavar="N",
                         help="processes tokenizing long completion prompts and parsing huge "
                              "bodies off the event loop (default: %(default)s)")
    sidecar.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="longest wait for the engine's response headers or next chunk "
                              "(default: %(default)s); then 504")
    sidecar.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                         help="a request's line and headers must arrive within this long "
                              "of the connection opening (default: %(default)s); then 408")
    sidecar.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                         help="a request's whole body must arrive within this long of "
                              "authentication (default: %(default)s); then 408")
    sidecar.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                         metavar="BYTES",
                         help="largest request body of any tenant (default: %(default)s); "
                              "a tenant's own cap follows from its quota, see "
                              "--body-bytes-per-token")
    sidecar.add_argument("--body-bytes-per-token", type=int, default=BODY_BYTES_PER_TOKEN,
                         metavar="BYTES",
                         help="body bytes allowed per prompt token a tenant may send "
                              "(default: %(default)s; raise it for image or audio input)")
    sidecar.add_argument("--max-connections", type=int, metavar="N",
                         help="client connections open at once; beyond, 503 (default: "
                              "half the file-descriptor limit, at most 4096)")
    sidecar.add_argument("--retry-after", type=int, default=1, metavar="SECONDS",
                         help="Retry-After on 429/503 (default: %(default)s)")
    sidecar.add_argument("--tenant-label-limit", type=int, default=100, metavar="N",
                         help="distinct tenant_id metric labels before 'other' "
                              "(default: %(default)s)")
    sidecar.add_argument("--log-level", default="info",
                         choices=["debug", "info", "warning", "error"])
    sidecar.add_argument("--access-log", action="store_true", help="log every request line")
    sidecar.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"),
                         default="auto",
                         help="auto: uvloop when installed, else asyncio's")
    sidecar.set_defaults(func=_run_sidecar)

    install = subparsers.add_parser(
        "install-plugin",
        help="copy the engine_sidecar package into DIR (initContainer for stock vLLM images)",
        description=(
            "Copies the engine_sidecar package (scheduler plugin and its policy/stats "
            "contract) into DIR/engine_sidecar, replacing an older copy atomically. Mount "
            "DIR into the vLLM container and add it to PYTHONPATH, then start vLLM with "
            "--scheduler-cls engine_sidecar.plugin.scheduler.TenantAwareScheduler. With --check, "
            "the pre-flight check then steps vLLM's real scheduler with that copy through "
            "admit, preempt, lease and finish on the vLLM found here (no model, no GPU); "
            f"inside a vLLM image without kvquota, run `python -m {preflight.__name__}`."
        ),
    )
    install.add_argument("dir", type=Path, metavar="DIR", nargs="?",
                         help="where to copy the package (optional with --check: then the "
                              "package installed here is checked)")
    install.add_argument("--check", action="store_true",
                         help="run the pre-flight check (exit 1 naming what this vLLM "
                              "lacks)")
    install.set_defaults(func=_run_install_plugin)


def check_server_flags(args: argparse.Namespace) -> tuple[tuple[str, int], tuple[str, int]]:
    """The client and admin addresses, once every connection bound is valid."""
    client = parse_listen(args.listen)
    admin = parse_listen(args.admin_listen, "--admin-listen")
    if admin[1] == client[1]:
        raise SystemExit(f"--admin-listen must use another port than --listen ({client[1]})")
    for flag, value in (("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout),
                        ("--max-body-bytes", args.max_body_bytes),
                        ("--body-bytes-per-token", args.body_bytes_per_token),
                        ("--tokenizer-workers", args.tokenizer_workers),
                        ("--max-connections", 1 if args.max_connections is None
                         else args.max_connections)):
        if value <= 0:
            raise SystemExit(f"{flag} must be positive, got {value}")
    return client, admin


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def build_gateway(args: argparse.Namespace, api_client_factory: Any = None) -> Gateway:
    """The gateway `kvquota sidecar` serves, from its flags and environment.

    `api_client_factory` replaces the in-cluster Kubernetes client of
    --policy-configmap (tests run the sidecar's own command line against an emulator)."""
    from engine_sidecar.gateway.app import Gateway, GatewayConfig
    from engine_sidecar.gateway.policy.source import (
        ConfigMapPolicySource,
        FilePolicySource,
        PolicySource,
    )

    source: PolicySource
    if args.policy_configmap:
        namespace, sep, name = args.policy_configmap.partition("/")
        if not sep or not namespace or not name:
            raise SystemExit("--policy-configmap must be NAMESPACE/NAME")
        source = ConfigMapPolicySource(namespace, name, api_client_factory=api_client_factory)
    else:
        source = FilePolicySource(args.policy_file)
    if args.secrets_dir is not None and not args.secrets_dir.is_dir():
        raise SystemExit(f"--secrets-dir {args.secrets_dir} is not a directory")
    plugin_policy_path = _env_path(POLICY_PATH_ENV)
    if plugin_policy_path and args.policy_file and (
        plugin_policy_path.resolve() == args.policy_file.resolve()
    ):
        plugin_policy_path = None  # the plugin already reads the file we poll
    config = GatewayConfig(
        upstream=args.upstream,
        secrets_dir=args.secrets_dir,
        pool_store_secrets_dir=args.pool_store_secrets_dir,
        plugin_policy_path=plugin_policy_path,
        stats_path=_env_path(STATS_PATH_ENV),
        tokenizer=args.tokenizer,
        engine_tokenizer=args.engine_tokenizer,
        tokenizer_workers=args.tokenizer_workers,
        request_timeout=args.request_timeout,
        retry_after_seconds=args.retry_after,
        tenant_label_limit=args.tenant_label_limit,
        max_body_bytes=args.max_body_bytes,
        body_bytes_per_token=args.body_bytes_per_token,
        body_timeout=args.body_timeout,
        engine_key=load_engine_key(args.engine_api_key_file),
        engine_id=os.environ.get(ENGINE_NAME_ENV) or None,
    )
    gateway = Gateway(config, source)
    if args.tokenizer:
        try:
            gateway.token_counter = gateway.load_tokenizer(args.tokenizer)
        except Exception as exc:  # whatever the loader raises: name it, stop
            raise SystemExit(f"--tokenizer {args.tokenizer!r} cannot be loaded "
                             f"({type(exc).__name__}: {str(exc)[:200]}); pass the model's "
                             "tokenizer, or --engine-tokenizer to count with the engine's "
                             "/tokenize") from None
    return gateway


def _run_sidecar(args: argparse.Namespace) -> int:
    import logging

    import prometheus_client
    import uvicorn

    from engine_sidecar.gateway import request_id, server
    from engine_sidecar.gateway.frozen_heap import freeze_startup_objects

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: "
                               "%(message)s")
    request_id.label_log_lines()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call
    prometheus_client.disable_created_metrics()  # no `_created` series per label set
    (host, port), (admin_host, admin_port) = check_server_flags(args)
    gateway = build_gateway(args)
    client_limits = server.ConnectionLimits(head_timeout=args.header_timeout,
                                            max_connections=args.max_connections)
    admin_limits = server.ConnectionLimits(head_timeout=args.header_timeout,
                                           max_connections=server.ADMIN_MAX_CONNECTIONS)
    client = uvicorn.Server(server.server_config(
        gateway.app, client_limits, lifespan="on", log_level=args.log_level,
        access_log=args.access_log))
    admin = server.AdminServer(server.server_config(
        gateway.admin_app, admin_limits, lifespan="off", log_level=args.log_level,
        access_log=args.access_log))
    request_id.label_log_lines()  # after uvicorn set up its loggers
    client_sock = server.listen(host, port, "--listen")
    admin_sock = server.listen(admin_host, admin_port, "--admin-listen")
    logging.getLogger(__name__).info(
        "clients on %s:%d (at most %d connections), admin on %s:%d",
        host, port, client_limits.connections(), admin_host, admin_port)
    # Whatever counts tokens (--engine-tokenizer loads none, and froze nothing): the
    # startup objects stay out of every collection a burst of requests triggers.
    freeze_startup_objects()
    server.run(server.serve(client, client_sock, admin, admin_sock), args.event_loop)
    return 0


def install_plugin(target: Path) -> Path:
    """Copy the plugin (`PLUGIN_PARTS` of the package) into target/engine_sidecar,
    replacing any older copy."""
    target.mkdir(parents=True, exist_ok=True)
    final = target / PACKAGE_DIR.name
    staging = Path(tempfile.mkdtemp(dir=target, prefix=".engine_sidecar."))
    try:
        package = staging / PACKAGE_DIR.name
        package.mkdir()
        for part in PLUGIN_PARTS:
            if (PACKAGE_DIR / part).is_dir():
                shutil.copytree(PACKAGE_DIR / part, package / part,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(PACKAGE_DIR / part, package / part)
        old = target / f".{PACKAGE_DIR.name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        (staging / PACKAGE_DIR.name).rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def check_installed_plugin(target: Path) -> int:
    """The pre-flight check on the copy in `target`, in a process that imports it from
    there (first on PYTHONPATH, and the working directory, which `-m` puts before it):
    what vLLM will load is what is checked."""
    target = target.resolve()
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", preflight.__name__],
        cwd=target, env={**os.environ, "PYTHONPATH": path}, check=False,
    ).returncode


def _run_install_plugin(args: argparse.Namespace) -> int:
    if args.dir is None:
        if not args.check:
            raise SystemExit("install-plugin: give DIR to copy the plugin into, or --check")
        return preflight.main([])
    final = install_plugin(args.dir)
    print(f"installed {final} (add {args.dir.resolve()} to PYTHONPATH)", flush=True)
    return check_installed_plugin(args.dir) if args.check else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m engine_sidecar.cli sidecar ...` without the operator's console script."""
    parser = argparse.ArgumentParser(prog="python -m engine_sidecar.cli")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
