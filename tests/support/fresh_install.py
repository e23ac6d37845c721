"""(tests/install, not tests/packaging: that name would shadow the `packaging` library.)

A fresh virtual environment holding the built kvquota wheel and, of everything else,
only what the wheel's own metadata requires.

Offline and quick: instead of asking a package index, the runtime dependencies are
taken from this test run's environment. Their closure is computed from the wheel's
`Requires-Dist` (with the extras it names, and no others), and only those
distributions are made visible to the fresh venv, through a directory of symlinks
named in a `.pth` file. Anything the wheel forgot to declare, and every optional extra
(vLLM, matplotlib, transformers, OpenTelemetry's SDK, the test tools), is absent there,
exactly as after `pip install kvquota` from an index.
"""

from __future__ import annotations

import email
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
# What `pip install .` reads in a checkout (the lab included; the images copy less:
# tests/manifests/test_images.py).
SOURCES = ("pyproject.toml", "README.md", "operator", "engine_sidecar", "lab",
           "manifests/samples")


def build_wheel(workdir: Path) -> Path:
    """Build the wheel from a copy of the sources (the checkout stays clean)."""
    src = workdir / "src"
    for name in SOURCES:
        source, target = REPO / name, src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, target)
    dist = workdir / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(dist), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = dist.glob("kvquota-*.whl")
    return wheel


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(archive.read(name))
    return [Requirement(r) for r in message.get_all("Requires-Dist") or ()]


def runtime_closure(requirements: list[Requirement], extras: tuple[str, ...] = (),
                    ) -> dict[str, metadata.Distribution]:
    """Every distribution of this environment that installing these requirements (with
    kvquota's `extras`, and no others) pulls in, by canonical name."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(r, extra) for r in requirements for extra in ("", *extras)]
    while pending:
        requirement, extra = pending.pop()
        environment = {**default_environment(), "extra": extra}
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        dist = metadata.distribution(requirement.name)  # PackageNotFoundError: not here
        if name not in found:
            found[name] = dist
            pending += [(Requirement(r), "") for r in dist.requires or ()]
        for wanted in requirement.extras:
            pending += [(Requirement(r), wanted) for r in dist.requires or ()]
    return found


def _top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """The site-packages entries a distribution installed (packages, modules, its
    .dist-info and shared-library folders); scripts outside site-packages are left out."""
    base = Path(str(dist.locate_file("")))
    entries = set()
    for file in dist.files or ():
        parts = Path(file).parts
        if parts and parts[0] not in ("..", "__pycache__"):
            entries.add(base / parts[0])
    return entries


def fresh_venv(workdir: Path, wheel: Path, extras: tuple[str, ...] = ()) -> Path:
    """A new venv with the wheel installed (no dependency resolution, no index) and
    its runtime dependencies, with `extras`, visible; returns its `bin` directory."""
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bin_dir = venv / "bin"
    python = bin_dir / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, text=True,
    )
    deps = workdir / "deps"
    deps.mkdir()
    for dist in runtime_closure(wheel_requirements(wheel), extras).values():
        for entry in _top_level_entries(dist):
            link = deps / entry.name
            if entry.exists() and not link.exists():
                link.symlink_to(entry)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(purelib, "kvquota-test-deps.pth").write_text(f"{deps}\n")
    return bin_dir


def clean_env(home: Path) -> dict[str, str]:
    """The environment a user's shell would have: no PYTHONPATH into the checkout, no
    virtualenv of the test run, a home and cache of its own."""
    keep = {"PATH", "LANG", "LC_ALL", "TMPDIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PYTHONNOUSERSITE="1",
               NO_COLOR="1")
    return env


