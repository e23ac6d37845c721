"""Aggregating engine reports and the disruption window (pure)."""

from __future__ import annotations

from engine_sidecar.contract.stats import (
    SidecarStatus,
    TenantCounters,
    TenantStatus,
    TenantUsage,
)
from kvquota.reconcile.usage import DisruptionWindow, aggregate


def _report(lease_breaks: int = 0, preemptions: int = 0, blocks: int = 0) -> SidecarStatus:
    return SidecarStatus(ready=True, total_blocks=100, free_blocks=100 - blocks, tenants={
        "a": TenantStatus(usage=TenantUsage(blocks=blocks, leased_blocks=blocks // 2),
                          counters=TenantCounters(lease_breaks=lease_breaks,
                                                  preemptions=preemptions)),
    })


def test_pool_usage_sums_over_engines() -> None:
    usage = aggregate([_report(blocks=10), _report(blocks=30)])
    assert usage.used_blocks == 40
    assert usage.leased_blocks == 20
    assert usage.tenants["a"].usage.blocks == 40


def test_queues_add_up_and_the_longest_wait_is_the_pools() -> None:
    def queued(depth: int, wait: float) -> SidecarStatus:
        return SidecarStatus(ready=True, tenants={"a": TenantStatus(
            usage=TenantUsage(queued=depth, queue_wait_seconds=wait))})

    usage = aggregate([queued(3, 2.5), queued(4, 7.0)]).tenants["a"].usage
    assert (usage.queued, usage.queue_wait_seconds) == (7, 7.0)


def test_window_counts_new_disruptions_only() -> None:
    window = DisruptionWindow(60)
    window.observe(0, {"e1": _report(lease_breaks=5)})  # baseline: history before us
    window.observe(10, {"e1": _report(lease_breaks=7)})
    seen = window.disruptions("a", 10)
    assert seen is not None and seen.lease_breaks == 2 and not seen.complete
    window.observe(100, {"e1": _report(lease_breaks=7)})
    quiet = window.disruptions("a", 100)
    assert quiet is not None and quiet.lease_breaks == 0 and quiet.complete


def test_engine_restart_counts_its_new_counters() -> None:
    window = DisruptionWindow(60)
    window.observe(0, {"e1": _report(preemptions=9)})
    window.observe(5, {"e1": _report(preemptions=1)})  # restarted: counters reset
    seen = window.disruptions("a", 5)
    assert seen is not None and seen.preemptions == 1


def test_nothing_known_before_the_first_poll() -> None:
    assert DisruptionWindow(60).disruptions("a", 0) is None
