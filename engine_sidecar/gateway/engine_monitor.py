"""Is the engine answering, and what does it serve (model id, context length)?

Probes `/health` periodically (faster while down); learns the model card from
`/v1/models` once the engine is up. A transport failure on the request path marks the
engine down at once, so `/readyz` turns false without waiting for the next probe.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

logger = logging.getLogger(__name__)


class EngineMonitor:
    def __init__(self, interval: float = 2.0, down_interval: float = 0.5) -> None:
        self.interval = interval
        self.down_interval = down_interval
        self.up = False
        self.error: str | None = "engine not probed yet"
        self.model: str | None = None
        self.model_root: str | None = None
        self.max_model_len: int | None = None

    def mark_down(self, reason: str) -> None:
        if self.up:
            logger.warning("engine marked down: %s", reason)
        self.up = False
        self.error = reason

    async def probe(self, client: httpx.AsyncClient) -> bool:
        try:
            response = await client.get("/health", timeout=2.0)
            healthy = response.status_code == 200
            reason = None if healthy else f"engine /health answered {response.status_code}"
        except httpx.HTTPError as exc:
            healthy, reason = False, f"engine unreachable ({type(exc).__name__})"
        if healthy and (self.model is None or not self.up):
            await self._learn_model(client)  # again after a restart: config may differ
        if healthy != self.up:
            logger.info("engine is %s", "up" if healthy else f"down: {reason}")
        self.up, self.error = healthy, reason
        return healthy

    async def _learn_model(self, client: httpx.AsyncClient) -> None:
        try:
            cards = (await client.get("/v1/models", timeout=5.0)).json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if cards and isinstance(cards[0], dict):
            card = cards[0]
            self.model = card.get("id") if isinstance(card.get("id"), str) else None
            self.model_root = card.get("root") if isinstance(card.get("root"), str) else None
            length = card.get("max_model_len")
            self.max_model_len = length if isinstance(length, int) and length > 0 else None

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.probe(client)
            await asyncio.sleep(self.interval if self.up else self.down_interval)
