"""Tokenizer worker processes: long prompts are encoded, and huge bodies parsed, off the
event loop, in a bounded pool.

Processes, because `Tokenizer.encode` holds the GIL for its whole run, so a thread
would stall the event loop for as long (docs/gateway.md has the figures). A worker has
its own GIL: the loop only copies the prompt into a pipe and the token ids back.

Bounded: at most `workers` jobs run and `2 x workers` are handed to the pool; up to
`max_waiting` more requests wait for at most `wait_seconds`; beyond either, 503
TOKENIZER_BUSY with Retry-After, so a flood of long prompts costs bounded memory and
never delays a short prompt, which is tokenized inline. Workers load the tokenizer from
its JSON (the Rust tokenizer alone) and import nothing else but the request parser.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")
PARENT_CHECK_S = 1.0  # how often a worker checks that the sidecar is still there
_worker_tokenizer: Any = None


def _init_worker(tokenizer_json: str, sidecar_pid: int) -> None:
    global _worker_tokenizer
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    threading.Thread(target=_exit_with, args=(sidecar_pid,), daemon=True,
                     name="kvquota-exit-with-sidecar").start()


def _exit_with(sidecar_pid: int) -> None:
    """(In a worker.) Exit once the sidecar is gone. A worker holds its own end of the
    pool's job queue, so a sidecar killed outright (SIGKILL, OOM) or exiting during a
    pool restart would otherwise leave it, and the resource tracker it keeps open,
    running for good beside the next sidecar."""
    while os.getppid() == sidecar_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _ready() -> bool:
    return _worker_tokenizer is not None


def encode(prompts: Sequence[str], add_special_tokens: bool) -> list[array[int]]:
    """(In a worker.) Each prompt's token ids.

    `encode_batch_fast` gives `encode`'s ids without tracking each token's character
    offsets, which nothing here reads, and costs the worker less CPU. One prompt per
    call, so a request of many prompts stays on the worker's one thread."""
    fast = getattr(_worker_tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21
    if fast is None:
        return [array("I", _worker_tokenizer.encode(
            p, add_special_tokens=add_special_tokens).ids) for p in prompts]
    return [array("I", fast([p], add_special_tokens=add_special_tokens)[0].ids)
            for p in prompts]


class TokenizerPool:
    def __init__(self, tokenizer_json: str, *, workers: int = 1, max_waiting: int = 64,
                 wait_seconds: float = 10.0, retry_after: int = 1) -> None:
        if workers < 1:
            raise ValueError("a tokenizer pool needs at least one worker")
        self._json = tokenizer_json
        self.workers = workers
        self.max_waiting = max_waiting
        self.wait_seconds = wait_seconds
        self.retry_after = retry_after
        self._executor = self._new_executor()
        # Per event loop (tests serve several sidecars, each in a loop of its own).
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())
        self.waiting = 0
        self.jobs = 0  # jobs run, for tests and metrics

    @classmethod
    def for_tokenizer(cls, backend: Any, **options: Any) -> TokenizerPool:
        """A pool for a `tokenizers.Tokenizer` (a fast tokenizer's `backend_tokenizer`)."""
        return cls(backend.to_str(), **options)

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: the sidecar has threads (uvicorn, httpx, policy watch).
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker,
                                   initargs=(self._json, os.getpid()))

    def start(self) -> None:
        """Start every worker now (they would start on first use, a second late)."""
        for future in [self._executor.submit(_ready) for _ in range(self.workers)]:
            future.result()

    def _busy(self, why: str) -> ApiError:
        return ApiError(503, errors.TOKENIZER_BUSY,
                        f"the sidecar's tokenizer is busy with long prompts ({why}); retry "
                        "later", retry_after=self.retry_after)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker; 503 TOKENIZER_BUSY when the pool stays full."""
        slots = self._slots.setdefault(asyncio.get_running_loop(),
                                       asyncio.Semaphore(2 * self.workers))
        if slots.locked():
            if self.waiting >= self.max_waiting:
                raise self._busy(f"{self.waiting} requests already wait")
            self.waiting += 1
            try:
                async with asyncio.timeout(self.wait_seconds):
                    await slots.acquire()
            except TimeoutError:
                raise self._busy(f"no worker free within {self.wait_seconds:g}s") from None
            finally:
                self.waiting -= 1
        else:
            await slots.acquire()
        try:
            self.jobs += 1
            future = self._executor.submit(fn, *args)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:  # a worker died (e.g. killed for memory): start afresh
            logger.error("a tokenizer worker died; restarting the pool")
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            raise self._busy("a worker restarted") from None
        finally:
            slots.release()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
