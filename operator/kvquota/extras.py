"""Optional extras: which `pip install 'kvquota[EXTRA]'` brings a missing module.

A command that needs an extra calls `require(...)` before doing any work, so a user
without it reads which extra to install instead of a traceback (or a crash deep inside
a worker process). `missing_extra(error)` maps an import failure found later to the
same message.
"""

from __future__ import annotations

import importlib.util

# Top-level module -> the extra that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    "vllm": "engine",
    "torch": "engine",
    "tokenizers": "engine",
    "safetensors": "engine",
    "transformers": "tokenizer",
    "starlette": "sidecar",
    "uvicorn": "sidecar",
    "msgspec": "sidecar",
    "jwt": "sidecar",
    "kopf": "operator",
    "celpy": "operator",

    "matplotlib": "lab",
    "kmock": "lab",
    "kvquota_lab": "lab",
    "opentelemetry": "tracing",
}
_NOTES = {
    "engine": " (vLLM's CPU build; on GPU nodes install the stock vllm wheel instead)",
    "lab": " (in a KVQuota checkout: the lab is in no image)",
}


class MissingExtra(Exception):
    """A command cannot run: an optional extra is not installed."""

    def __init__(self, command: str, extra: str, modules: list[str]) -> None:
        self.command, self.extra, self.modules = command, extra, modules
        super().__init__(
            f"{command} needs {', '.join(modules)}, from the '{extra}' extra: "
            f"pip install 'kvquota[{extra}]'{_NOTES.get(extra, '')}"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(command: str, *modules: str) -> None:
    """Raise `MissingExtra` for the first extra some of `modules` belong to and lack."""
    for module in modules:
        if not _installed(module):
            extra = EXTRA_OF_MODULE[module]
            missing = [m for m in modules if EXTRA_OF_MODULE[m] == extra and not _installed(m)]
            raise MissingExtra(command, extra, missing)


def missing_extra(command: str, error: ModuleNotFoundError) -> MissingExtra | None:
    """The extra behind an import failure, if it is one of ours."""
    top = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    return MissingExtra(command, extra, [top]) if extra else None
