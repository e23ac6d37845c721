"""A policy an earlier operator wrote into a pool's ConfigMap meets today's sidecar and
operator: the sidecar accepts it (its version checks out), and today's operator renders
the very same bytes from the same objects, so an upgrade rewrites no ConfigMap and no
engine reloads."""

from __future__ import annotations

from pathlib import Path

from engine_sidecar.contract.policy import EnginePolicy
from kvquota.local import render, scan

REPO = Path(__file__).resolve().parents[2]
# Rendered by the operator at 67145cc from manifests/samples, split over 3 replicas.
WRITTEN = Path(__file__).parent / "fixtures" / "policies" / "samples-3-replicas.json"


def test_a_policy_an_earlier_operator_wrote_loads_with_its_version() -> None:
    old = EnginePolicy.from_json(WRITTEN.read_text())
    assert old.version and old.version == old.content_hash()
    assert set(old.tenants) == {"acme", "globex", "hobbyist"}


def test_todays_operator_renders_the_same_bytes_from_the_same_objects(tmp_path: Path) -> None:
    report = render(scan(REPO / "manifests" / "samples"), tmp_path, replicas=3)
    assert report.ok, report.errors
    rendered = (tmp_path / "policies" / "default.demo-pool.json").read_text()
    assert rendered == WRITTEN.read_text()
