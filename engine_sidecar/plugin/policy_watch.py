"""Hot-load of the EnginePolicy file for the scheduler plugin (no vLLM import).

The sidecar replaces the file atomically; the plugin polls it between steps. A file
that does not parse or validate never replaces the last good policy: the error is
logged once per file version and surfaced in the stats until a good file arrives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from engine_sidecar.contract import errors, files
from engine_sidecar.contract.names import ENGINE_NAME_ENV
from engine_sidecar.contract.policy import EnginePolicy

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
_MAX_ERROR_LEN = 500



class PolicyWatcher:
    """Holds the current policy and reloads it when the file changes.

    `poll()` stats the file at most every `interval` seconds (by `clock`) and reads it
    only when its (inode, size, mtime) signature changed. `policy` is what this engine
    enforces: its entry of the per-engine split (`EnginePolicy.for_engine`) by `engine`,
    by default the pod name from the environment.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        interval: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        log: bool = True,
        engine: str | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.engine = engine or os.environ.get(ENGINE_NAME_ENV) or None
        self.log = log
        self.policy: EnginePolicy | None = None
        self.error: str | None = None
        self._watch = files.FileWatch(self.path or "", interval=interval, clock=clock)

    @property
    def version(self) -> str | None:
        if self.policy is None:
            return None
        return self.policy.version or self.policy.content_hash()

    def poll(self, *, force: bool = False) -> bool:
        """Reload if due and changed; True when a new policy was applied."""
        if self.path is None:
            return False
        if not self._watch.due() and not force:
            return False
        try:
            changed = self._watch.look()
        except OSError as exc:
            self._fail(f"cannot stat policy file {self.path}: {exc.strerror or exc}")
            return False
        if not changed:
            return False
        if self._watch.signature is None:
            if self.policy is not None:
                self._fail(f"policy file {self.path} is missing")
            return False
        return self._load()

    def _load(self) -> bool:
        assert self.path is not None
        try:
            raw = self.path.read_bytes()
            policy = EnginePolicy.from_json(raw).for_engine(self.engine)
        except OSError as exc:
            self._fail(f"cannot read policy file {self.path}: {exc.strerror or exc}")
            return False
        except ValidationError as exc:
            detail = (errors.problems(exc) or [str(exc)])[0]
            self._fail(f"invalid policy file {self.path} ({exc.error_count()} errors; {detail})")
            return False
        except ValueError as exc:
            self._fail(f"invalid policy file {self.path}: {exc}")
            return False
        changed = policy.version != (self.policy.version if self.policy else None) or (
            not policy.version and policy != self.policy
        )
        self.policy = policy
        if self.error is not None and self.log:
            logger.info("KVQuota policy file %s is valid again", self.path)
        self.error = None
        if changed and self.log:
            logger.info(
                "KVQuota policy %s loaded: %d tenants", self.version, len(policy.tenants)
            )
        return changed

    def _fail(self, message: str) -> None:
        message = message[:_MAX_ERROR_LEN]
        if self.policy is not None:
            message += f" (keeping {self.version})"
        if message != self.error and self.log:
            logger.error("KVQuota %s", message)
        self.error = message
