"""`kvquota inject -f FILE [--pool NAME]`: the webhook's injection, offline.

Like `istioctl kube-inject`: reads Pods, Deployments, StatefulSets (any pod-template
workload) from multi-document YAML (`-` for stdin) and prints them injected; other
objects pass through unchanged. The same code as the operator's webhook.

A pod already injected stays as it is; with `--upgrade`, one injected by an older
release is brought to this release's names and sidecar image instead (the names a
release renamed: engine_sidecar/contract/renamed.py). Without it, such a pod is only
named on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "inject", help="add the KVQuota sidecar and plugin to vLLM pods in YAML (offline)",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("-f", "--filename", required=True, metavar="FILE",
                        help="YAML file (multi-document); - reads stdin")
    parser.add_argument("--pool", metavar="NAME", help="the InferencePool the engines serve "
                        "(default: each pod template's kvquota.dev/pool label)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the pool's spec.model: vLLM serves it (--served-model-name) "
                             "where a pod names no served name of its own, so responses "
                             "carry the name clients ask for (the webhook reads the pool)")
    parser.add_argument("--image", help="sidecar image (default: the release's)")
    parser.add_argument("--secret", help="the Secret the pool's spec.auth names "
                        "(default: kvquota-auth)")
    parser.add_argument("--pool-store-secret", help="the Secret the pool's "
                        "spec.poolStore.passwordSecretRef names (default: kvquota-pool-store; "
                        "optional: pods start without it)")
    parser.add_argument("--upgrade", action="store_true",
                        help="also rewrite pods injected by an older release to this "
                             "release's names (e.g. the plugin's --scheduler-cls path) and "
                             "sidecar image (--image); each change is listed on stderr")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import dataclasses

    import yaml

    from kvquota.inject.objects import describe, inject_object
    from kvquota.inject.pod import InjectionOptions, InjectionRefused
    from kvquota.inject.upgrade import deprecated_names, upgrade_object

    changes: dict[str, Any] = {k: v for k, v in (("image", args.image),
                                                 ("secret", args.secret),
                                                 ("store_secret", args.pool_store_secret)) if v}
    options = dataclasses.replace(InjectionOptions(), **changes)
    try:
        if args.filename == "-":
            text = sys.stdin.read()
        else:
            with open(args.filename) as handle:
                text = handle.read()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        print(f"kvquota inject: cannot read {args.filename}: {exc}", file=sys.stderr)
        return 2
    out = []
    for doc in docs:
        if not isinstance(doc, dict):
            print(f"kvquota inject: {args.filename}: a document is not a Kubernetes object",
                  file=sys.stderr)
            return 2
        if args.upgrade:
            upgraded = upgrade_object(doc, options.image, options.store_secret)
            for change in upgraded.changes:
                print(f"kvquota inject: upgraded {change}", file=sys.stderr)
            doc = upgraded.obj
        for renamed in deprecated_names(doc):
            print(f"kvquota inject: {describe(doc)} names {renamed.old}, deprecated since "
                  f"{renamed.since} and gone in {renamed.removed_in}: rerun with --upgrade",
                  file=sys.stderr)
        try:
            out.append(inject_object(doc, args.pool, options,
                                     served_model_name=args.served_model_name))
        except InjectionRefused as exc:
            print(f"kvquota inject: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0
