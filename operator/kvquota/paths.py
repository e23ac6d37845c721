"""Where kvquota finds its shipped data and keeps what it generates.

Shipped files (the sample manifests, bench scenarios) are package data, read with
`importlib.resources`, so they are found the same from a checkout and from an
installed wheel. Generated things (the tiny model, demo runs, local-mode output) go
to the user's cache, never into the installation.
"""

from __future__ import annotations

import os
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path


def user_cache() -> Path:
    """`$XDG_CACHE_HOME/kvquota` (absolute values only, as the spec says), else
    `~/.cache/kvquota`."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "kvquota"


def samples() -> Traversable:
    """The sample InferencePool and TenantQuotas (`manifests/samples` in the repo)."""
    return resources.files("kvquota").joinpath("samples")


def copy_samples(target: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """Copy the shipped sample manifests (except the names in `skip`) into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in samples().iterdir():
        if entry.is_file() and entry.name.endswith(".yaml") and entry.name not in skip:
            (target / entry.name).write_bytes(entry.read_bytes())
    return target
