"""Reads the scheduler plugin's stats file (live KV capacity, per-tenant engine usage).

The plugin replaces the file atomically at >= 2 Hz while the engine runs. Reading is
throttled (a stat at most every `min_interval` seconds, a parse only when it changed),
so the request path can ask for the latest stats on every admission. Stats older than
`max_age` (by their own timestamp) count as none: an engine that died or hangs leaves
its last file behind, and admitting against it would trust capacity nobody measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from engine_sidecar.contract import files
from engine_sidecar.contract.names import STALE_AFTER_S
from engine_sidecar.contract.stats import EngineStats


class EngineStatsReader:
    def __init__(
        self,
        path: Path | None,
        min_interval: float = 0.1,
        *,
        max_age: float = STALE_AFTER_S,
        clock: Callable[[], float] = time.time,  # the wall clock the plugin stamps with
    ) -> None:
        self.path = path
        self.min_interval = min_interval
        self.max_age = max_age
        self.clock = clock
        self.error: str | None = None
        self._stats: EngineStats | None = None
        self._watch = files.FileWatch(path or "", interval=min_interval)

    def current(self) -> EngineStats | None:
        """The latest readable stats; None if the plugin has published none, or none
        younger than `max_age` (admission then treats capacity as unknown)."""
        stats = self.latest()
        if stats is None or self.clock() - stats.timestamp > self.max_age:
            return None
        return stats

    def age(self) -> float | None:
        """Seconds since the plugin wrote the latest readable stats (None: none)."""
        stats = self.latest()
        return None if stats is None else max(0.0, self.clock() - stats.timestamp)

    def stale(self) -> bool:
        """The plugin published stats, but none younger than `max_age`."""
        age = self.age()
        return age is not None and age > self.max_age

    def latest(self) -> EngineStats | None:
        """The latest readable stats, however old."""
        if self.path is None:
            return None
        if not self._watch.due():
            return self._stats
        try:
            changed = self._watch.look()
        except OSError:
            changed = True
        if self._watch.signature is None:
            self._stats = None
            return None
        if not changed:
            return self._stats
        try:
            self._stats = EngineStats.model_validate_json(self.path.read_bytes())
            self.error = None
        except (OSError, ValidationError, ValueError) as exc:
            # Keep the previous stats: a transient read error must not flip admission.
            self.error = f"unreadable engine stats: {type(exc).__name__}"
        return self._stats
