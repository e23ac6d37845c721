"""The plugin's stats channel: a JSON file (`EngineStats`) replaced atomically.

The scheduler runs in vLLM's EngineCore process, not next to the sidecar, so it
publishes through the file at `$KVQUOTA_STATS_PATH` (a shared volume in the pod). The
engine thread builds a snapshot at start, at most every `STEP_INTERVAL_S` while it
steps, and whenever it goes idle; a daemon thread writes the latest one, and rewrites
it every `HEARTBEAT_S` while the engine idles, so readers always see a fresh
timestamp. While idle it reports the state the next step will start from: expired
leases off the books, and a new policy file as the policy in force.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.names import HEARTBEAT_S
from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.contract.stats import EngineStats, TenantEngineStats
from engine_sidecar.plugin.policy_watch import PolicyWatcher
from engine_sidecar.plugin.rules.leases import lease_seconds

logger = logging.getLogger(__name__)

STEP_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class LeaseView:
    tenant: str  # tenant id (leases only exist for tenants the policy knows)
    session: str
    last_activity: float  # on the scheduler's clock
    expires_at: float  # on the scheduler's clock, under the policy the step used
    exclusive_blocks: int  # pinned only by this lease (freed when it ends)


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """What one step saw. `stats` counts every lease that was live at that step."""

    stats: EngineStats
    leases: tuple[LeaseView, ...] = ()

    def render(
        self,
        now: float,
        wall_time: float,
        *,
        policy: EnginePolicy | None = None,
        policy_error: str | None = None,
    ) -> EngineStats:
        """The stats as of `now` (scheduler clock), stamped with `wall_time`.

        `policy`, when given and not the one the step used, is the policy file the
        next step will apply; `policy_error` is what reading that file reported."""
        stats = self.stats.model_copy(deep=True)
        stats.timestamp = wall_time
        pending = policy is not None and _version(policy) != stats.policy_version
        if policy is not None and pending:
            stats.policy_version = _version(policy)
            for tenant_id in policy.tenants:
                stats.tenants.setdefault(tenant_id, TenantEngineStats())
        if policy is not None or policy_error is not None:
            stats.policy_error = policy_error
        for lease in self.leases:
            expires_at = lease.expires_at
            if policy is not None and pending:
                expires_at = lease.last_activity + lease_seconds(policy, lease.tenant)
            if expires_at > now:
                continue
            tenant = stats.tenants.get(lease.tenant)
            if tenant is not None:
                tenant.leased_sessions = max(0, tenant.leased_sessions - 1)
                tenant.leased_blocks = max(0, tenant.leased_blocks - lease.exclusive_blocks)
                tenant.pinned_blocks = max(0, tenant.pinned_blocks - lease.exclusive_blocks)
                tenant.leases.pop(lease.session, None)
            stats.free_blocks = min(stats.total_blocks, stats.free_blocks + lease.exclusive_blocks)
        return stats


def _version(policy: EnginePolicy) -> str:
    return policy.version or policy.content_hash()


class StatsPublisher:
    """Writes the latest snapshot from a daemon thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        policy_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self.heartbeat = heartbeat
        # The thread's own, silent view of the policy file (the engine thread logs).
        self._policy = PolicyWatcher(policy_path, clock=clock, log=False) if policy_path else None
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
            policy, error = None, None
            if self._policy is not None:
                self._policy.poll()
                policy, error = self._policy.policy, self._policy.error
            stats = snapshot.render(self.clock(), time.time(), policy=policy, policy_error=error)
            write_atomically(self.path, stats.model_dump_json(by_alias=True))
        except Exception as exc:  # the channel must never take the engine down
            if not self._failed:
                logger.error("KVQuota cannot write stats to %s: %s", self.path, exc)
            self._failed = True
        else:
            if self._failed:
                logger.info("KVQuota stats at %s are written again", self.path)
            self._failed = False
