"""Every name users carry keeps working: each one `frozen_names.yaml` lists is still in
the product, and a renamed one only while it still works, warns, and says when it goes.

A release may add names freely; this fails only on a removal or rename without the old
name kept (engine_sidecar/contract/renamed.py, README: upgrade)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_sidecar.contract.renamed import RENAMED, Renamed

from .frozen_names import (
    COMMANDS,
    command_flags,
    condition_names,
    crd_names,
    frozen,
    metric_labels,
    product_strings,
    python_path_works,
    warns_when_imported,
)

STRING_KINDS = ("env", "headers", "error_codes", "keys")


def _missing(names: dict[str, Any]) -> Iterator[str]:
    """`kind: name` of every frozen name that no longer works."""
    yield from (f"python: {p}" for p in names["python"] if not python_path_works(p))
    flags = command_flags()
    for command in COMMANDS:
        yield from (f"flags: kvquota {command} {flag}" for flag in names["flags"][command]
                    if flag not in flags[command])
    strings = product_strings()
    for kind in STRING_KINDS:
        yield from (f"{kind}: {name}" for name in names[kind] if name not in strings)
    conditions = condition_names()
    for kind in ("types", "reasons"):
        yield from (f"condition {kind}: {name}" for name in names["conditions"][kind]
                    if name not in conditions[kind])
    metrics = metric_labels()
    for metric, labels in names["metrics"].items():
        if metric not in metrics:
            yield f"metrics: {metric}"
            continue
        yield from (f"metrics: {metric} label {label}" for label in labels
                    if label not in metrics[metric])
    crds = crd_names()
    for kind, entries in names["crd"].items():
        yield from (f"crd: {kind} {entry}" for entry in entries
                    if entry not in crds.get(kind, ()))


def test_every_frozen_name_still_works() -> None:
    missing = list(_missing(frozen()))
    assert missing == [], (
        "removed or renamed without keeping the old name: keep it working with a "
        "deprecation warning, list it in engine_sidecar/contract/renamed.py and "
        f"CHANGELOG.md (README: upgrade): {missing}")


def test_the_frozen_list_itself_is_not_empty_anywhere() -> None:
    """A section that reads nothing would let every removal through."""
    names = frozen()
    assert all(names[kind] for kind in ("python", *STRING_KINDS, "metrics"))
    assert all(names["flags"][command] for command in COMMANDS)
    assert names["conditions"]["types"] and names["conditions"]["reasons"]
    assert set(names["crd"]) == {"InferencePool", "TenantQuota"}


@pytest.mark.parametrize("renamed", RENAMED, ids=lambda r: r.old)
def test_a_renamed_name_is_frozen_beside_its_successor_and_warns(renamed: Renamed) -> None:
    python = frozen()["python"]

    def listed(path: str) -> bool:
        return any(p == path or p.startswith(path + ".") for p in python)

    assert listed(renamed.old) and listed(renamed.new)
    assert warns_when_imported(renamed.old, renamed.old)


def test_removing_a_name_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a name the product dropped, of each kind, is reported."""
    names = frozen()
    names["python"] = [*names["python"], "engine_sidecar.plugin.scheduler.GoneScheduler"]
    names["flags"]["sidecar"] = [*names["flags"]["sidecar"], "--gone-flag"]
    names["headers"] = [*names["headers"], "x-kvquota-gone"]
    names["metrics"] = {**names["metrics"], "kvquota_admissions": ["tenant_id", "gone"]}
    names["crd"]["TenantQuota"] = [*names["crd"]["TenantQuota"], "v1alpha1 spec.gone"]
    assert sorted(_missing(names)) == [
        "crd: TenantQuota v1alpha1 spec.gone",
        "flags: kvquota sidecar --gone-flag",
        "headers: x-kvquota-gone",
        "metrics: kvquota_admissions label gone",
        "python: engine_sidecar.plugin.scheduler.GoneScheduler",
    ]
