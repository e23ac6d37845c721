"""README's "where each part lives" tables match the tree: every path they name exists,
and every part of the engine side and of the lab is named."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "lab" / "kvquota_lab"
TOP = ("operator/", "engine_sidecar/", "lab/", "crds/", "manifests/", "e2e/", "tests/")


def _table(heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after the line that starts with `heading`."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def _paths(cell: str, base: Path) -> list[Path]:
    """The files and folders a cell names. A bare file name is in the folder named last
    before it (`crds.py` after `operator/kvquota/api.py`); a relative path with a folder
    in it is beside the last full path's folder (`handlers/injection.py` after
    `operator/kvquota/inject/`), or in `base`."""
    found, folder, anchor = [], base, base
    for name in re.findall(r"`([^`\s]+)`", cell):
        if not (name.endswith((".py", "/")) or "/" in name) or "<" in name:
            continue
        if name.startswith(TOP):
            path = REPO / name
            anchor = path.parent
        else:
            path = (anchor if "/" in name.rstrip("/") or name.endswith("/") else folder) / name
        found.append(path)
        folder = path if name.endswith("/") else path.parent
    return found


def test_every_path_the_tables_name_exists() -> None:
    named = [p for row in _table("Where each part lives") for p in _paths(row[1], REPO)]
    named += [p for row in _table("The lab, `lab/kvquota_lab/`") for p in _paths(row[1], LAB)]
    assert len(named) > 20
    assert [str(p.relative_to(REPO)) for p in named if not p.exists()] == []


def test_every_part_of_the_engine_side_and_of_the_lab_is_named() -> None:
    main = {p.resolve() for row in _table("Where each part lives") for p in _paths(row[1], REPO)}
    lab = {p.resolve() for row in _table("The lab, `lab/kvquota_lab/`")
           for p in _paths(row[1], LAB)}
    engine_parts = [p for p in (REPO / "engine_sidecar").iterdir()
                    if p.is_dir() and (p / "__init__.py").exists()]
    contract = [p for p in (REPO / "engine_sidecar" / "contract").glob("*.py")
                if p.name != "__init__.py"]
    assert [p.name for p in [*engine_parts, *contract] if p.resolve() not in main] == []
    lab_parts = [p for p in LAB.iterdir() if p.name != "__init__.py" and (
        p.suffix == ".py" or (p / "__init__.py").exists())]
    assert [p.name for p in lab_parts if p.resolve() not in lab] == []
