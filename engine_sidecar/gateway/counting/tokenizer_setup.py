"""Which tokenizer counts prompts, found and loaded while the sidecar starts.

The engine's /tokenize when asked for (`--engine-tokenizer`); else the tokenizer named
(`--tokenizer`), or found: the engine's model, then the policy's. None loadable is an
error the readiness shows, never a silent fall-back to a round trip per request.
"""

from __future__ import annotations

import asyncio
import logging

from engine_sidecar.gateway.config import GatewayConfig
from engine_sidecar.gateway.counting.token_pool import TokenizerPool
from engine_sidecar.gateway.counting.tokens import EngineTokenCounter, HfTokenCounter, TokenCounter
from engine_sidecar.gateway.frozen_heap import freeze_startup_objects
from engine_sidecar.gateway.policy.active import PolicyHolder
from engine_sidecar.gateway.relay.exchange import Upstream
from engine_sidecar.gateway.telemetry.status import hide_paths
from engine_sidecar.gateway.upstream.engine_monitor import EngineMonitor

logger = logging.getLogger(__name__)


class TokenizerSetup:
    """`counter` once one is loaded (or given); `error` when none could be."""

    def __init__(self, config: GatewayConfig, upstream: Upstream, monitor: EngineMonitor,
                 holder: PolicyHolder, counter: TokenCounter | None = None) -> None:
        self.config = config
        self.upstream = upstream
        self.monitor = monitor
        self.holder = holder
        self.counter = counter
        self.error: str | None = None
        self._pools: list[TokenizerPool] = []  # started by `load`: ours to close

    def load(self, name: str) -> HfTokenCounter:
        """The local tokenizer `name`, its worker pool started (blocking; raises what the
        loader raises)."""
        counter = HfTokenCounter.load(name, EngineTokenCounter(self.upstream, None),
                                      workers=self.config.tokenizer_workers,
                                      retry_after=self.config.retry_after_seconds)
        if counter.pool is not None:
            self._pools.append(counter.pool)
            counter.pool.start()
        freeze_startup_objects()
        return counter

    def close(self) -> None:
        """Stop the worker processes of the pools `load` started (a counter given from
        outside keeps its own)."""
        while self._pools:
            self._pools.pop().close()

    async def run(self) -> None:
        """Find and load the counter (the gateway's lifespan runs this when none was
        given)."""
        if self.config.engine_tokenizer:
            self.counter = EngineTokenCounter(self.upstream, None)
            return
        tried: dict[str, str] = {}
        while True:
            candidates = [self.config.tokenizer] if self.config.tokenizer else [
                self.monitor.model_root, self.monitor.model,
                self.holder.active.policy.model if self.holder.active else None,
            ]
            for name in candidates:
                if not name or name in tried:
                    continue
                try:
                    self.counter = await asyncio.to_thread(self.load, name)
                    logger.info("counting prompt tokens with %s", self.counter.description)
                    return
                except Exception as exc:  # any loader failure: try the next candidate
                    tried[name] = type(exc).__name__
                    logger.warning("tokenizer %r not loadable here (%s)", name, tried[name])
            if self.config.tokenizer or (self.monitor.model and self.holder.active):
                break
            await asyncio.sleep(1.0)
        self.error = (
            "no tokenizer could be loaded (tried " + ", ".join(
                f"{hide_paths(name)}: {error}" for name, error in tried.items())
            + "); pass --tokenizer with the model's tokenizer, or --engine-tokenizer to count "
            "every prompt with the engine's /tokenize (one round trip per request)")
        logger.error("%s", self.error)
