"""The files the engine pod's containers share: written whole, watched by signature.

The sidecar writes the policy and the plugin its stats with `write_atomically`, so a
reader sees the old or the new content, never a torn file. Readers poll
`signature(path)` and read again only when it changed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

Signature = tuple[int, int, int]  # (inode, size, mtime ns): an atomic replace changes it


def write_atomically(path: str | Path, text: str) -> None:
    """Replace `path` so readers see the old or the new content, never a torn file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, 0o644)  # policy and stats are read by the other container's user
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def signature(path: str | Path) -> Signature | None:
    """What changes whenever `path` is replaced or rewritten; None while it is missing.
    Other errors (permissions) raise `OSError`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
