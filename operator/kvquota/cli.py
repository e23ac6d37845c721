"""`kvquota`: one console script, one subcommand per tool.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds a
parser whose `func(args) -> int` runs it. Modules keep heavy imports inside `func` so
`kvquota --help` stays fast.

Each image holds only its own commands: a command whose module is not there is not
listed (the sidecar image has no `operator`). The lab's commands (`kvquota_lab`: demo,
bench, tiny model), and any command whose extra's dependencies are missing, are listed
as stubs that say which extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from engine_sidecar.contract.names import API_VERSION
from kvquota import __version__
from kvquota.extras import MissingExtra, missing_extra

# command -> (the module that registers it, the extra its dependencies come from), in
# the order `--help` lists them.
COMMANDS = {
    "operator": ("kvquota.run_operator", "operator"),
    "inject": ("kvquota.inject.cli", "operator"),
    "sidecar": ("engine_sidecar.cli", "sidecar"),
    "install-plugin": ("engine_sidecar.cli", "sidecar"),
    "crds": ("kvquota.api.crd", ""),
    "demo": ("kvquota_lab.demo", "lab"),
    "bench": ("kvquota_lab.bench.cli", "lab"),
    "tiny-model": ("kvquota_lab.tinymodel", "lab"),
}


def _unavailable(command: str, error: ModuleNotFoundError) -> MissingExtra | None:
    """Why `command` cannot run here: None when its module is simply not part of this
    installation (an image holds only its own commands), else the extra to install."""
    module, extra = COMMANDS[command]
    missing = error.name or ""
    if (module == missing or module.startswith(missing + ".")) and extra != "lab":
        return None
    named = missing_extra(f"kvquota {command}", error)  # vLLM, say: not the command's
    if named is not None and named.extra != extra and named.extra in ("engine", "lab"):
        return named
    if not extra:
        raise error
    return MissingExtra(f"kvquota {command}", extra, [missing.split(".")[0]])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvquota", description="Per-tenant KV-cache quotas for vLLM."
    )
    parser.add_argument("--version", action="version",
                        version=f"kvquota {__version__} (API {API_VERSION})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    unavailable: dict[str, MissingExtra] = {}
    for module_name in dict.fromkeys(module for module, _ in COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            for command in (c for c, (m, _) in COMMANDS.items() if m == module_name):
                reason = _unavailable(command, error)
                if reason is None:
                    continue
                # Listed only: `main` answers these before parsing their arguments.
                subparsers.add_parser(command, add_help=False,
                                      help=f"(needs the '{reason.extra}' extra)")
                unavailable[command] = reason
            continue
        module.register(subparsers)
    parser.set_defaults(unavailable=unavailable)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    unavailable = parser.get_default("unavailable")
    if argv and argv[0] in unavailable:
        print(f"error: {unavailable[argv[0]]}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as error:  # an extra's module, imported late
        missing = _unavailable(args.command, error)
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
