"""Is the engine answering, and what does it serve (model id, context length)?

Probes `/health` periodically (faster while down); learns the model card from
`/v1/models` once the engine is up. A transport failure on the request path makes the
monitor probe at once, so `/readyz` turns false without waiting for the next period;
one failed request alone never marks the engine down.

A probe that fails inside the sidecar (out of file descriptors or socket buffers: the
sidecar's problem, not the engine's) leaves the engine's state as it was and is logged
as the sidecar's own error: it must not make the pod unready and the operator re-split
quotas over the other engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time

import httpx

logger = logging.getLogger(__name__)

# Failures to open a socket that say nothing about the engine.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
MIN_RECHECK_S = 0.1  # failed requests trigger probes at most this often


def local_errno(exc: BaseException) -> int | None:
    """The errno of a local resource shortage anywhere in `exc`'s cause chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in LOCAL_ERRNOS:
            return current.errno
        current = current.__cause__ or current.__context__
    return None


class EngineMonitor:
    def __init__(self, interval: float = 2.0, down_interval: float = 0.5) -> None:
        self.interval = interval
        self.down_interval = down_interval
        self.up = False
        self.error: str | None = "engine not probed yet"
        self.local_error: str | None = None  # the last probe failed in the sidecar itself
        self.model: str | None = None
        self.model_root: str | None = None
        self.served: tuple[str, ...] = ()  # every card's id: the base model, then adapters
        self._client: httpx.AsyncClient | None = None
        self.max_model_len: int | None = None
        self._recheck = asyncio.Event()

    def recheck(self) -> None:
        """A request could not reach the engine: probe now rather than trust it."""
        self._recheck.set()

    async def probe(self, client: httpx.AsyncClient) -> bool:
        try:
            response = await client.get("/health", timeout=2.0)
            healthy = response.status_code == 200
            reason = None if healthy else f"engine /health answered {response.status_code}"
        except httpx.HTTPError as exc:
            local = local_errno(exc)
            if local is not None:
                self.local_error = f"the sidecar cannot open a socket ({errno.errorcode[local]})"
                logger.warning("engine probe failed in the sidecar, not the engine: %s; "
                               "keeping the engine %s", self.local_error,
                               "up" if self.up else "down")
                return self.up
            healthy, reason = False, f"engine unreachable ({type(exc).__name__})"
        self.local_error = None
        if healthy and (self.model is None or not self.up):
            await self._learn_model(client)  # again after a restart: config may differ
        if healthy != self.up:
            logger.info("engine is %s", "up" if healthy else f"down: {reason}")
        self.up, self.error = healthy, reason
        return healthy

    async def learn_models(self) -> None:
        """Read the engine's model cards again (an adapter may have been loaded since)."""
        if self._client is not None:
            await self._learn_model(self._client)

    async def _learn_model(self, client: httpx.AsyncClient) -> None:
        try:
            cards = (await client.get("/v1/models", timeout=5.0)).json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if not isinstance(cards, list):
            return
        self.served = tuple(card["id"] for card in cards
                            if isinstance(card, dict) and isinstance(card.get("id"), str))
        if cards and isinstance(cards[0], dict):
            card = cards[0]
            self.model = card.get("id") if isinstance(card.get("id"), str) else None
            self.model_root = card.get("root") if isinstance(card.get("root"), str) else None
            length = card.get("max_model_len")
            self.max_model_len = length if isinstance(length, int) and length > 0 else None

    async def run(self, client: httpx.AsyncClient) -> None:
        self._client = client
        while True:
            self._recheck.clear()
            started = time.monotonic()
            await self.probe(client)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(),
                                       self.interval if self.up else self.down_interval)
            await asyncio.sleep(max(0.0, started + MIN_RECHECK_S - time.monotonic()))
