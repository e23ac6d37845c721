"""What an injected pod must satisfy, whichever path injected it (webhook or CLI)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from manifests.atomic import unfilled_atomic_fields
from manifests.schemas import schema_errors

from engine_sidecar.contract.names import ENGINE_NAME_ENV, PLUGIN_CLASS
from kvquota.cli import build_parser
from kvquota.inject.pod import INIT, SIDECAR
from kvquota.inject.vllm_argv import VllmCommand

# Each flag the plugin needs, once, with its value (parsed by vLLM's own parser).
PLUGIN_FLAGS = ("--scheduler-cls", "--scheduling-policy", "--enable-prompt-tokens-details",
                "--enable-prefix-caching", "--host", "--port")


def vllm_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] != SIDECAR]
    return container


def check_injected_pod(
    pod: dict[str, Any], parser: argparse.ArgumentParser
) -> argparse.Namespace:
    """Schema-valid, nothing left for the API server to fill in an atomic struct, vLLM's
    argv parses, the plugin flags appear exactly once; returns vLLM's parsed arguments
    for further checks."""
    assert schema_errors(pod) == []
    # What injection adds, re-applied by another field manager (a GitOps tool re-syncing
    # `kvquota inject` output), must not conflict. The workload's own env is the user's
    # (the check-plugin init container copies the vLLM container's).
    spec = pod["spec"]
    added = {"kind": "Pod", "spec": {
        "containers": [c for c in [*spec.get("initContainers", []), *spec["containers"]]
                       if c["name"] in (SIDECAR, INIT)],
        "env": [e for e in vllm_container(pod).get("env", []) if e["name"] == ENGINE_NAME_ENV],
    }}
    missing = unfilled_atomic_fields(added)
    assert missing == [], missing
    command = VllmCommand.parse(vllm_container(pod))
    argv = command.server_argv()
    names = [t.split("=", 1)[0].replace("_", "-") for t in argv if t.startswith("--")]
    for flag in PLUGIN_FLAGS:
        assert names.count(flag) == 1, (flag, argv)
    parsed = parser.parse_args(argv)
    assert parsed.scheduler_cls == PLUGIN_CLASS
    assert parsed.scheduling_policy == "priority"
    assert parsed.enable_prompt_tokens_details is True
    assert parsed.enable_prefix_caching is True
    assert parsed.host == "127.0.0.1"
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == SIDECAR]
    upstream = sidecar["command"][sidecar["command"].index("--upstream") + 1]
    assert upstream == f"http://127.0.0.1:{parsed.port}"  # the sidecar reaches vLLM
    # `kvquota sidecar` accepts its command line (the kubelet expands $(VAR) first).
    expanded = [re.sub(r"\$\((\w+)\)", "x", arg) for arg in sidecar["command"][1:]]
    build_parser().parse_args(expanded)
    return parsed
