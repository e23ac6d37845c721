"""`kvquota sidecar` (the admission gateway) and `kvquota install-plugin` (initContainer).

Heavy imports (starlette, uvicorn, httpx, transformers) stay inside the commands so
`kvquota --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine_sidecar.stats import POLICY_PATH_ENV, STATS_PATH_ENV

PACKAGE_DIR = Path(__file__).resolve().parent


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
                         help="address to serve on (default: %(default)s)")
    sidecar.add_argument("--upstream", default="http://127.0.0.1:8001", metavar="URL",
                         help="the vLLM OpenAI server (default: %(default)s)")
    source = sidecar.add_mutually_exclusive_group(required=True)
    source.add_argument("--policy-file", type=Path, metavar="PATH",
                        help="poll this EnginePolicy JSON file")
    source.add_argument("--policy-configmap", metavar="NAMESPACE/NAME",
                        help="watch this ConfigMap's policy.json (in-cluster credentials)")
    sidecar.add_argument("--secrets-dir", type=Path, metavar="DIR",
                         help="mounted Secret: the JWT key file named by the policy and the "
                              "'cache-salt' pool secret")
    sidecar.add_argument("--tokenizer", metavar="PATH_OR_NAME",
                         help="tokenizer for prompt counting (default: the engine's model, "
                              "then the policy's; else the engine's /tokenize)")
    sidecar.add_argument("--engine-tokenizer", action="store_true",
                         help="count prompt tokens with the engine's /tokenize endpoint only")
    sidecar.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="longest wait for the engine's response headers or next chunk "
                              "(default: %(default)s); then 504")
    sidecar.add_argument("--retry-after", type=int, default=1, metavar="SECONDS",
                         help="Retry-After on 429/503 (default: %(default)s)")
    sidecar.add_argument("--tenant-label-limit", type=int, default=100, metavar="N",
                         help="distinct tenant_id metric labels before 'other' "
                              "(default: %(default)s)")
    sidecar.add_argument("--log-level", default="info",
                         choices=["debug", "info", "warning", "error"])
    sidecar.add_argument("--access-log", action="store_true", help="log every request line")
    sidecar.set_defaults(func=_run_sidecar)

    install = subparsers.add_parser(
        "install-plugin",
        help="copy the engine_sidecar package into DIR (initContainer for stock vLLM images)",
        description=(
            "Copies the engine_sidecar package (scheduler plugin and its policy/stats "
            "contract) into DIR/engine_sidecar, replacing an older copy atomically. Mount "
            "DIR into the vLLM container and add it to PYTHONPATH, then start vLLM with "
            "--scheduler-cls engine_sidecar.scheduler.TenantAwareScheduler."
        ),
    )
    install.add_argument("dir", type=Path, metavar="DIR")
    install.set_defaults(func=_run_install_plugin)


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"--listen must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _run_sidecar(args: argparse.Namespace) -> int:
    import logging

    import prometheus_client
    import uvicorn

    from engine_sidecar.gateway.app import Gateway, GatewayConfig
    from engine_sidecar.gateway.policy_source import (
        ConfigMapPolicySource,
        FilePolicySource,
        PolicySource,
    )

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call
    prometheus_client.disable_created_metrics()  # no `_created` series per label set
    host, port = parse_listen(args.listen)
    source: PolicySource
    if args.policy_configmap:
        namespace, sep, name = args.policy_configmap.partition("/")
        if not sep or not namespace or not name:
            raise SystemExit("--policy-configmap must be NAMESPACE/NAME")
        source = ConfigMapPolicySource(namespace, name)
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
        plugin_policy_path=plugin_policy_path,
        stats_path=_env_path(STATS_PATH_ENV),
        tokenizer=args.tokenizer,
        engine_tokenizer=args.engine_tokenizer,
        request_timeout=args.request_timeout,
        retry_after_seconds=args.retry_after,
        tenant_label_limit=args.tenant_label_limit,
    )
    gateway = Gateway(config, source)
    server = uvicorn.Server(uvicorn.Config(
        gateway.app, host=host, port=port, log_level=args.log_level,
        access_log=args.access_log, server_header=False, lifespan="on", interface="asgi3",
        proxy_headers=False,  # client addresses are not used; skip the middleware
        timeout_graceful_shutdown=30,
    ))
    server.run()
    return 0


def install_plugin(target: Path) -> Path:
    """Copy the package into target/engine_sidecar, replacing any older copy."""
    target.mkdir(parents=True, exist_ok=True)
    final = target / PACKAGE_DIR.name
    staging = Path(tempfile.mkdtemp(dir=target, prefix=".engine_sidecar."))
    try:
        shutil.copytree(PACKAGE_DIR, staging / PACKAGE_DIR.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        old = target / f".{PACKAGE_DIR.name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        (staging / PACKAGE_DIR.name).rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _run_install_plugin(args: argparse.Namespace) -> int:
    final = install_plugin(args.dir)
    print(f"installed {final} (add {args.dir.resolve()} to PYTHONPATH)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m engine_sidecar.cli sidecar ...` without the operator's console script."""
    parser = argparse.ArgumentParser(prog="python -m engine_sidecar.cli")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
