"""The plugin's stats channel: a JSON file (`EngineStats`) replaced atomically.

The scheduler runs in vLLM's EngineCore process, not next to the sidecar, so it
publishes through the file at `$KVQUOTA_STATS_PATH` (a shared volume in the pod). The
step builds a self-contained snapshot at most every `STEP_INTERVAL_S` and whenever the
engine goes idle; a daemon thread writes it, and rewrites the latest one every
`HEARTBEAT_S` while the engine is idle (vLLM's engine loop blocks then), so readers
always see a fresh timestamp. The thread never reads scheduler state: leases that
expire while the engine idles are taken off the snapshot by their expiry time (their
blocks go back to vLLM's LRU at the next step, before any allocation).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.policy import write_atomically
from engine_sidecar.stats import EngineStats

logger = logging.getLogger(__name__)

STEP_INTERVAL_S = 0.25
HEARTBEAT_S = 0.5


@dataclass(frozen=True, slots=True)
class LeaseView:
    tenant: str  # stats key
    expires_at: float  # on the scheduler's clock
    exclusive_blocks: int  # pinned only by this lease (freed when it ends)


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """What one step saw. `stats` counts every lease that was live at that step."""

    stats: EngineStats
    leases: tuple[LeaseView, ...] = ()

    def render(self, now: float, wall_time: float) -> EngineStats:
        """The stats as of `now` (scheduler clock), stamped with `wall_time`."""
        stats = self.stats.model_copy(deep=True)
        stats.timestamp = wall_time
        for lease in self.leases:
            if lease.expires_at > now:
                continue
            tenant = stats.tenants.get(lease.tenant)
            if tenant is not None:
                tenant.leased_sessions = max(0, tenant.leased_sessions - 1)
                tenant.leased_blocks = max(0, tenant.leased_blocks - lease.exclusive_blocks)
            stats.free_blocks = min(stats.total_blocks, stats.free_blocks + lease.exclusive_blocks)
        return stats


class StatsPublisher:
    """Writes the latest snapshot from a daemon thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self.heartbeat = heartbeat
        self._latest: StatsSnapshot | None = None
        self._wake = threading.Event()
        self._stop = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="kvquota-stats", daemon=True)
        self._thread.start()

    def publish(self, snapshot: StatsSnapshot) -> None:
        self._latest = snapshot  # a single reference swap: the thread sees old or new
        self._wake.set()

    def close(self, final: StatsSnapshot | None = None) -> None:
        if final is not None:
            self._latest = final
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._write()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.heartbeat)
            self._wake.clear()
            if not self._stop:
                self._write()

    def _write(self) -> None:
        snapshot = self._latest
        if snapshot is None:
            return
        try:
            stats = snapshot.render(self.clock(), time.time())
            write_atomically(self.path, stats.model_dump_json(by_alias=True))
        except Exception as exc:  # the channel must never take the engine down
            if not self._failed:
                logger.error("KVQuota cannot write stats to %s: %s", self.path, exc)
            self._failed = True
        else:
            if self._failed:
                logger.info("KVQuota stats at %s are written again", self.path)
            self._failed = False
