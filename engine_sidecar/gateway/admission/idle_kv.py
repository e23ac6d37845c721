"""Time requests waited on their tenant's maxBlocks while the blocks they asked for sat
idle: the "waited beside idle KV" a platform team reads per tenant.

Charged between two pumps of the admission queue, to tenants whose queued requests
waited on maxBlocks (not for capacity) and would have fit in the free blocks above the
watermark, while no queued request of anyone waited for capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IdleKvWaits:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # per tenant
        self._last: float | None = None

    def note(self, now: float, capped: Sequence[tuple[str, int]],
             idle_blocks: Callable[[], int | None]) -> None:
        """Charge the time since the last note to each (tenant, blocks asked) in `capped`
        that `idle_blocks()` (free above the watermark; None: unknown) would have fit."""
        since, self._last = self._last, now
        if since is None or now <= since or not capped:
            return
        idle = idle_blocks()
        if idle is None:
            return
        for tenant_id, new_blocks in capped:
            if new_blocks <= idle:
                self.seconds[tenant_id] = self.seconds.get(tenant_id, 0.0) + now - since
