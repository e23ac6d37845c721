"""vLLM's API key, carried from the vLLM container to the sidecar's environment.

vLLM started with `--api-key KEY` (or `VLLM_API_KEY`) wants that key on /v1/*, while
clients send the sidecar their tenant's token; the sidecar sends vLLM's key upstream,
read from its own `VLLM_API_KEY`. The key's definition is copied (a Secret reference
stays a reference; no key is ever read here), with every variable it names. A key that
reaches vLLM only through `envFrom` is not visible: docs/operator.md, "vLLM's API key".
"""

from __future__ import annotations

import copy
import re
from typing import Any

from engine_sidecar.contract.names import ENGINE_KEY_ENV
from kvquota.inject.vllm_argv import VllmCommand

_REFERENCE = re.compile(r"(?<!\$)\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class KeyRefused(ValueError):
    """vLLM's key cannot be carried to the sidecar; the message says why."""


def engine_key_env(vllm: dict[str, Any], command: VllmCommand, taken: set[str]
                   ) -> list[dict[str, Any]]:
    """The env entries that give the sidecar vLLM's key ([] when vLLM has none).

    `taken`: names the sidecar defines itself; a key that refers to one is refused."""
    env = [e for e in vllm.get("env") or [] if isinstance(e, dict) and e.get("name")]
    flags = [f for f in command.find("api-key") if f.value is not None]
    if flags:
        key_entry: dict[str, Any] = {"name": ENGINE_KEY_ENV, "value": flags[-1].value}
        before = env
    else:
        at = next((i for i, e in enumerate(env) if e["name"] == ENGINE_KEY_ENV), None)
        if at is None:
            return []
        key_entry, before = copy.deepcopy(env[at]), env[:at]
    needed = _referenced(key_entry, before)
    clash = sorted({e["name"] for e in needed} & taken)
    if clash:
        raise KeyRefused(f"vLLM's API key refers to ${clash[0]}, which the KVQuota sidecar "
                         "sets itself; give the key through another variable")
    return [*needed, key_entry]


def _referenced(entry: dict[str, Any], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The definitions `entry`'s value names, with theirs, in definition order."""
    by_name = {e["name"]: i for i, e in enumerate(before)}
    wanted: set[int] = set()
    pending = [entry]
    while pending:
        value = pending.pop().get("value")
        for name in _REFERENCE.findall(value) if isinstance(value, str) else []:
            i = by_name.get(name)
            if i is not None and i not in wanted:
                wanted.add(i)
                pending.append(before[i])
    return [copy.deepcopy(before[i]) for i in sorted(wanted)]
