"""What the plugin is built with: its files, its clock, its victim ranking.

vLLM builds the scheduler itself, from `--scheduler-cls`, with vLLM's arguments only;
in an engine the plugin therefore reads its files from the environment the sidecar's
injection sets (`PluginConfig.from_env`). Whoever builds the scheduler directly (the
twin, the pre-flight check, tests) passes a `PluginConfig` instead, so nothing has to
be changed on a scheduler after it is built.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.contract.names import POLICY_PATH_ENV, STATS_PATH_ENV
from engine_sidecar.plugin.rules.ranking import VictimRanker


@dataclass(frozen=True)
class PluginConfig:
    # The EnginePolicy file the sidecar writes (None: every request is unclassified).
    policy_path: str | Path | None = None
    # Where the plugin publishes its EngineStats (None: nowhere).
    stats_path: str | Path | None = None
    # Seconds, monotonic; the twin passes its virtual time.
    clock: Callable[[], float] = time.monotonic
    # The victim order's rules; the benchmark's ablations pass a subclass.
    ranker: type[VictimRanker] = VictimRanker
    # The engine whose entry of the per-engine split to enforce (None: the pod name
    # from the environment).
    engine: str | None = None

    @classmethod
    def from_env(cls) -> PluginConfig:
        return cls(
            policy_path=os.environ.get(POLICY_PATH_ENV) or None,
            stats_path=os.environ.get(STATS_PATH_ENV) or None,
        )
