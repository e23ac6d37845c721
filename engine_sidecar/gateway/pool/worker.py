"""Where the pool-wide ledger's round trips run: never on the sidecar's event loop.

`StoreThread` runs them one at a time, in order, on a thread of its own (a release
written through before a charge asked after it reaches the store first); what waits on
an answer is called back on the event loop. Handing a call over takes no lock the
thread may hold (a `queue.SimpleQueue`), so the loop never waits for it. `Inline` runs
them in the caller, at once: the twin's virtual time and the tests that step a queue by
hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Runner(Protocol):
    def run(self, call: Callable[[], T], answered: Callable[[T], None] | None = None) -> None:
        """Run `call`; then `answered(result)` (on the event loop, for a thread; at once,
        inline)."""
        ...


class Inline:
    def run(self, call: Callable[[], T], answered: Callable[[T], None] | None = None) -> None:
        result = call()
        if answered is not None:
            answered(result)


class StoreThread:
    """One thread for one sidecar's store calls, started with it."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(self, call: Callable[[], T], answered: Callable[[T], None] | None = None) -> None:
        if answered is None:
            self._calls.put(call)
            return
        loop = asyncio.get_running_loop()

        def job() -> None:
            result = call()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(answered, result)

        self._calls.put(job)

    def close(self) -> None:
        """Calls already handed over still run; the thread then ends."""
        self._calls.put(None)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # a store call catches its own errors; keep serving
                logger.exception("kvquota: a pool store call failed")
