"""`kvquota operator`: run the operator against a cluster, or in local mode on files.

Cluster mode runs kopf with the handlers of `kvquota.handlers`, under the settings of
`kvquota.settings`. High availability is kopf peering: the replica with the highest
`--priority` works, the others stay paused (docs/operator.md, "High availability").
`--metrics HOST:PORT` serves Prometheus metrics, a paused standby's too. Local mode
(`--local DIR [--out OUT]`, `kvquota.local`) needs no cluster.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from kvquota.settings import PEERING_NAME

if TYPE_CHECKING:
    from kvquota.inject.webhook import WebhookConfig
    from kvquota.runtime import OperatorConfig

def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the operator (against the cluster, or --local on YAML files)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    local = parser.add_argument_group("local mode (no cluster)")
    local.add_argument("--local", metavar="DIR", help="read the YAML objects in DIR (never "
                       "written to); write policies to OUT/policies/ and status to OUT/status/")
    local.add_argument("--out", metavar="OUT", help="where local mode writes (default: "
                       "$XDG_CACHE_HOME/kvquota/local/<DIR name>-<hash of DIR>, printed on start)")
    local.add_argument("--once", action="store_true", help="render once and exit; non-zero "
                       "if any object is invalid or a quota is not accepted")
    local.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engine replicas to split quotas over (default: 1)")
    local.add_argument("--watch-interval", type=float, default=0.5, metavar="SECONDS",
                       help="how often to look for changed files (default: 0.5)")

    cluster = parser.add_argument_group("cluster mode")
    scope = cluster.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default)")
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch only this namespace (repeatable)")
    cluster.add_argument("--liveness", metavar="URL",
                         help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    cluster.add_argument("--metrics", metavar="HOST:PORT", type=_metrics_address,
                         help="serve Prometheus metrics on /metrics, e.g. 0.0.0.0:9090")
    peering = cluster.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true",
                         help=f"no peering (single replica); default: peering {PEERING_NAME!r} "
                         "when kopf's peering CRD is installed")
    peering.add_argument("--require-peering", action="store_true",
                         help="stay paused until the peering CRD exists (HA installs)")
    cluster.add_argument("--priority", type=int, default=0,
                         help="peering priority: the highest live replica works; "
                         "give each replica a distinct one")
    cluster.add_argument("--peering-lifetime", type=int, default=60, metavar="SECONDS",
                         help="how long peers trust this replica's keep-alive: a replica "
                         "that dies is replaced this long after its last one (default: 60)")
    cluster.add_argument("--poll-interval", type=float, default=10.0, metavar="SECONDS",
                         help="how often each pool's engines are polled (default: 10)")
    cluster.add_argument("--engine-timeout", type=float, default=2.0, metavar="SECONDS",
                         help="timeout of one sidecar status request (default: 2)")
    cluster.add_argument("--degraded-window", type=float, default=300.0, metavar="SECONDS",
                         help="Degraded reports disruptions this recent (default: 300)")
    webhook = parser.add_argument_group(
        "sidecar injection webhook (pods labelled kvquota.dev/pool; see kvquota.inject)")
    webhook.add_argument("--webhook-listen", default="0.0.0.0:9443", metavar="HOST:PORT",
                         help="where the HTTPS webhook listens (default: 0.0.0.0:9443)")
    webhook.add_argument("--webhook-cert-dir", metavar="DIR", help="tls.crt/tls.key (and "
                         "ca.crt) from cert-manager; default: self-signed, renewed by the "
                         "operator, its CA published in the webhook configuration")
    webhook.add_argument("--webhook-service", default="kvquota-webhook.kvquota-system",
                         metavar="NAME.NAMESPACE", help="the Service the API server calls "
                         "(the self-signed certificate's names)")
    webhook.add_argument("--sidecar-image", help="the image injected pods run the sidecar "
                         "and plugin installer from (default: this release's)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(func=main)


def _metrics_address(value: str) -> tuple[str, int]:
    from kvquota.metrics import parse_address

    try:
        return parse_address(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(args: argparse.Namespace) -> int:
    if args.local:
        from kvquota.local import run_local

        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
        return run_local(args.local, once=args.once, output=args.out,
                         replicas=args.replicas, interval=args.watch_interval)
    if args.once or args.out:
        raise SystemExit("kvquota operator: --once and --out need --local DIR")

    from kvquota.runtime import OperatorConfig

    config = OperatorConfig(
        poll_interval=args.poll_interval,
        engine_timeout=args.engine_timeout,
        degraded_window=args.degraded_window,
        webhook=webhook_config(args),
        metrics_address=args.metrics,
        peering_lifetime=args.peering_lifetime,
        namespaces=tuple(args.namespace),
    )
    run_cluster(
        config,
        verbose=args.verbose,
        liveness=args.liveness,
        standalone=args.standalone,
        require_peering=args.require_peering,
        priority=args.priority,
    )
    return 0


def webhook_config(args: argparse.Namespace) -> WebhookConfig:
    from pathlib import Path

    from engine_sidecar.contract.listen import parse_listen
    from kvquota.inject.pod import InjectionOptions
    from kvquota.inject.webhook import WebhookConfig

    addr, port = parse_listen(args.webhook_listen, "--webhook-listen")
    service, dot, namespace = args.webhook_service.partition(".")
    if not dot or not service or not namespace:
        raise SystemExit(f"kvquota operator: --webhook-service must be NAME.NAMESPACE, got "
                         f"{args.webhook_service!r}")
    options = InjectionOptions(image=args.sidecar_image) if args.sidecar_image else (
        InjectionOptions())
    return WebhookConfig(addr=addr, port=port, service=service, namespace=namespace,
                         cert_dir=Path(args.webhook_cert_dir) if args.webhook_cert_dir
                         else None, options=options)


def run_cluster(
    config: OperatorConfig,
    *,
    verbose: bool = False,
    liveness: str | None = None,
    standalone: bool = False,
    require_peering: bool = False,
    priority: int = 0,
) -> None:
    """Run kopf until interrupted (blocking); watches `config.namespaces`, or all.
    Exits (SystemExit, naming what is missing) when required peering cannot work."""
    import kopf

    import kvquota.handlers  # noqa: F401  (registers the handlers)
    from kvquota.handlers.lifecycle import PeeringUnavailable

    kopf.configure(verbose=verbose)
    try:
        kopf.run(
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=standalone,
            priority=priority,
            # Named here, peering is mandatory; else `configure_settings` names it
            # (optional).
            peering_name=PEERING_NAME if require_peering else None,
            liveness_endpoint=liveness,
            memo=kopf.Memo(config=config),
        )
    except Exception as error:  # kopf wraps a failed startup handler in its own error
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, PeeringUnavailable):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise SystemExit(f"kvquota operator: {cause}") from None
