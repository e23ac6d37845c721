"""The plugin's stats file as admission sees it: written by the plugin's own publisher,
read on a clock the test moves (no sleeping for stats to age)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_sidecar.contract.names import STALE_AFTER_S
from engine_sidecar.contract.stats import EngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.rules import pool_view
from engine_sidecar.gateway.telemetry.engine_stats import EngineStatsReader
from engine_sidecar.plugin.stats_publisher import StatsPublisher, StatsSnapshot

from .helpers import make_policy, tenant


def _publish_once(path: Path) -> float:
    """What the plugin writes as it stops (close): one file, stamped with time.time()."""
    publisher = StatsPublisher(path, clock=lambda: 0.0, heartbeat=3600)
    publisher.close(StatsSnapshot(EngineStats(timestamp=0.0, total_blocks=1000,
                                              free_blocks=600)))
    return EngineStats.model_validate_json(path.read_bytes()).timestamp


def test_stats_the_plugin_stopped_writing_count_as_unknown_capacity(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    written = _publish_once(path)
    now = [written]
    reader = EngineStatsReader(path, min_interval=0, clock=lambda: now[0])
    policy, ledger = make_policy(tenant("acme")), Ledger()

    now[0] = written + STALE_AFTER_S - 0.5
    view = pool_view(policy, reader.current(), ledger)
    assert (view.source, view.total_blocks, view.free_blocks) == ("engine", 1000, 600)
    assert not reader.stale()

    now[0] = written + STALE_AFTER_S + 0.5  # the engine died: nobody rewrites the file
    assert reader.current() is None
    assert not pool_view(policy, reader.current(), ledger).known
    assert reader.stale() and reader.age() == pytest.approx(STALE_AFTER_S + 0.5)

    rewritten = _publish_once(path)  # the engine is back
    now[0] = rewritten + 0.1
    assert reader.current() is not None and not reader.stale()

