"""The files the engine pod's containers share: written whole, watched by signature.

The sidecar writes the policy and the plugin its stats with `write_atomically`, so a
reader sees the old or the new content, never a torn file. Readers poll with a
`FileWatch` (or compare `signature(path)` themselves) and read again only when it
changed: an atomic replace, an in-place rewrite and kubelet's symlink swap of a
mounted ConfigMap or Secret all change it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
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


class FileWatch:
    """One file, polled: `look()` says whether it changed since the previous look.

    `due()` throttles the looks to one per `interval` seconds of `clock`. `signature`
    is the latest look's (None: the file was missing).
    """

    def __init__(self, path: str | Path, *, interval: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.interval = interval
        self.clock = clock
        self.signature: Signature | None = None
        self._next = -float("inf")

    def due(self) -> bool:
        """True at most once per `interval`: time for a look."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.interval
        return True

    def look(self) -> bool:
        """Whether the file appeared, changed or disappeared since the previous look. An
        error other than a missing file (permissions) raises `OSError` and counts as
        missing for the next look."""
        try:
            current = signature(self.path)
        except OSError:
            self.signature = None
            raise
        changed, self.signature = current != self.signature, current
        return changed
