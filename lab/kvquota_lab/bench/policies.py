"""The policies a bench compares: stock vLLM FCFS, stock priority, KVQuota.

Each names the scheduler the twin runs, whether requests go through the sidecar's
admission, and whether they carry their tier's vLLM priority. Every backend and the
victim-order variants build on this list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvquota_lab.twin.harness import SchedulerKind


@dataclass(frozen=True)
class PolicySpec:
    key: str
    label: str
    scheduler: SchedulerKind
    admission: bool  # requests go through the sidecar's admission
    tier_priority: bool  # requests carry their tier's vLLM priority
    variant: str | None = None  # KVQuota victim-order variant (None: the default)


POLICIES: dict[str, PolicySpec] = {
    "fcfs": PolicySpec("fcfs", "stock vLLM FCFS", "stock-fcfs", False, False),
    "priority": PolicySpec("priority", "stock vLLM priority", "stock-priority", False, True),
    "kvquota": PolicySpec("kvquota", "KVQuota", "kvquota", True, True),
    # Not in the default set: the plugin alone, every request admitted (shows what the
    # victim order and leases do when memory does run out).
    "plugin": PolicySpec("plugin", "KVQuota plugin only", "kvquota", False, True),
}
BASELINE = PolicySpec("baseline", "baseline: no noisy tiers", "stock-fcfs", False, False)
