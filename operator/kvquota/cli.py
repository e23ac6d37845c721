"""`kvquota`: one console script, one subcommand per tool.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds a
parser whose `func(args) -> int` runs it. Modules keep heavy imports inside `func` so
`kvquota --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvquota import API_VERSION, __version__
from kvquota.extras import MissingExtra, missing_extra

# (module, ...) in the order `--help` lists them.
COMMAND_MODULES = (
    "kvquota.demo",
    "kvquota.bench.cli",
    "kvquota.run_operator",
    "kvquota.inject.cli",
    "engine_sidecar.cli",
    "kvquota.crdgen",
    "kvquota.tinymodel",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvquota", description="Per-tenant KV-cache quotas for vLLM."
    )
    parser.add_argument("--version", action="version",
                        version=f"kvquota {__version__} (API {API_VERSION})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not exc.name or not name.startswith(exc.name):  # a real missing dependency
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as error:  # an extra's module, imported late
        missing = missing_extra(f"kvquota {args.command}", error)
        if missing is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return 2
    except MissingExtra as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
