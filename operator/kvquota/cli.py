"""`kvquota`: one console script, one subcommand per tool.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds a
parser whose `func(args) -> int` runs it. Modules keep heavy imports inside `func` so
`kvquota --help` stays fast.

The product's commands come first. The lab's (`kvquota_lab`: demo, bench, tiny model)
are listed only where the lab is installed; elsewhere (the images) each of them is a
stub that says how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvquota import API_VERSION, __version__
from kvquota.extras import MissingExtra, lab_installed, missing_extra

# (module, ...) in the order `--help` lists them. An image holds only some of them.
COMMAND_MODULES = (
    "kvquota.run_operator",
    "kvquota.inject.cli",
    "engine_sidecar.cli",
    "kvquota.crdgen",
)
# command -> its lab module.
LAB_COMMANDS = {
    "demo": "kvquota_lab.demo",
    "bench": "kvquota_lab.bench.cli",
    "tiny-model": "kvquota_lab.tinymodel",
}


def _lab_missing(command: str) -> MissingExtra:
    return MissingExtra(f"kvquota {command}", "lab", ["kvquota_lab"])


def _register_lab(subparsers: argparse._SubParsersAction) -> None:
    if lab_installed():
        for name in LAB_COMMANDS.values():
            importlib.import_module(name).register(subparsers)
        return
    for command in LAB_COMMANDS:
        # Listed in --help only: `main` answers these before parsing their arguments.
        subparsers.add_parser(command, help="(lab; not installed)", add_help=False)


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
    _register_lab(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LAB_COMMANDS and not lab_installed():
        print(f"error: {_lab_missing(argv[0])}", file=sys.stderr)
        return 2
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
