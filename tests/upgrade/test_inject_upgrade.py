"""`kvquota inject --upgrade` on manifests 0.1.0 injected: they come out as this release
injects the same specs, and without the flag they are left alone but named."""

from __future__ import annotations

import io

import pytest
import yaml

from engine_sidecar.contract.renamed import RENAMED
from kvquota.cli import main
from kvquota.inject.pod import INIT, SIDECAR, InjectionOptions

from .conftest import NAMES, OLD, ORIGINAL, container, load_old


def _inject(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[object], str]:
    capsys.readouterr()
    assert main(["inject", *argv]) == 0
    out, err = capsys.readouterr()
    return list(yaml.safe_load_all(out)), err


@pytest.mark.parametrize("name", NAMES)
def test_upgrade_gives_what_this_release_injects(
    name: str, capsys: pytest.CaptureFixture[str],
) -> None:
    upgraded, err = _inject(capsys, "--upgrade", "-f", str(OLD / name))
    fresh, _ = _inject(capsys, "-f", str(ORIGINAL / name))
    assert upgraded == fresh
    text = yaml.safe_dump_all(upgraded)
    assert not [r.old for r in RENAMED if r.old + "\n" in text or r.old + "=" in text]
    image = InjectionOptions().image
    for change in (f"{RENAMED[0].old} -> {RENAMED[0].new}", f"{RENAMED[1].old} -> {RENAMED[1].new}",
                   f"{SIDECAR}': image ghcr.io/kvquota/sidecar:v0.1.0 -> {image}",
                   f"{INIT}': image ghcr.io/kvquota/sidecar:v0.1.0 -> {image}"):
        assert change in err, err


def test_upgrade_to_a_chosen_image_and_again_changes_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "plain-deployment.yaml"
    (once,), _ = _inject(capsys, "--upgrade", "--image", "registry.local/sidecar:v0.2.0",
                         "-f", str(OLD / name))
    assert isinstance(once, dict)
    assert container(once, SIDECAR)["image"] == "registry.local/sidecar:v0.2.0"
    assert container(once, INIT)["image"] == "registry.local/sidecar:v0.2.0"
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(once)))
    (twice,), err = _inject(capsys, "--upgrade", "--image", "registry.local/sidecar:v0.2.0",
                            "-f", "-")
    assert twice == once and err == ""


def test_without_upgrade_an_old_pod_is_kept_and_its_old_names_are_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "production-stack.yaml"
    (out,), err = _inject(capsys, "-f", str(OLD / name))
    assert out == load_old(name)
    for renamed in RENAMED[:2]:  # the class path and the pre-flight module
        assert f"names {renamed.old}, deprecated since 0.2.0 and gone in 0.4.0: rerun with " \
               "--upgrade" in err
