"""Degraded mode's books: episodes, and one log line per episode.

When nothing ranks above the request that needs blocks and no other request runs, the
plugin releases live leases so the engine keeps making progress; an episode ends with
the first step in which no allocation failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class DegradedEpisodes:
    """Degraded-mode bookkeeping: one log line per episode, not per release."""

    def __init__(self, log: Callable[..., None] | None = None) -> None:
        self.active = False
        self.episodes = 0
        self.releases_in_episode = 0
        self._log = log or logger.warning

    def note_release(self, tenant: str, num_blocks: int) -> None:
        if not self.active:
            self.active = True
            self.episodes += 1
            self.releases_in_episode = 0
            self._log(
                "KVQuota degraded: KV cache exhausted with only higher-class work left; "
                "releasing live leases, oldest premium last (first: tenant %s, %d blocks)",
                tenant, num_blocks,
            )
        self.releases_in_episode += 1

    def end_step(self, allocation_failed: bool) -> bool:
        """Close the episode after a step without allocation failure; True if closed."""
        if self.active and not allocation_failed:
            self.active = False
            logger.info(
                "KVQuota degraded episode %d over after %d lease releases",
                self.episodes, self.releases_in_episode,
            )
            return True
        return False
