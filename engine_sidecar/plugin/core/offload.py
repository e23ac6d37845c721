"""What happened to preempted requests when the engine offloads KV.

vLLM V1 has no swap: a preempted request either recomputes its KV or, with a KV
offloading connector, reloads what the connector stored. A victim that held fewer than
the policy's `recomputeBelowBlocks` recomputes (the connector's hit is declined);
larger ones are left to the connector and show as swapped blocks while they wait.
Without offloading every preemption is a recompute.
"""

from __future__ import annotations

from collections import Counter

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.plugin.core.engine_port import Engine, Request


class OffloadAccounting:
    def __init__(self, engine: Engine, *, offloading: bool) -> None:
        self._engine = engine
        self.offloading = offloading
        self.modes: Counter[str] = Counter()  # preemptions by mode, as they resolve
        # Preempted requests not yet resumed (req_id -> blocks they held), and those of
        # them that must recompute rather than reload.
        self.preempted: dict[str, int] = {}
        self.recompute: set[str] = set()

    @property
    def mode(self) -> str:
        return "offload" if self.offloading else "recompute"

    def preempted_request(self, req_id: str, num_blocks: int,
                          policy: EnginePolicy | None) -> None:
        if not self.offloading:
            self.modes["recompute"] += 1
            return
        self.preempted[req_id] = num_blocks
        threshold = policy.recompute_below_blocks if policy is not None else 0
        if num_blocks < threshold:
            self.recompute.add(req_id)

    def on_kv_load(self, request: Request, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a waiting request, `num_external_tokens` of them
        to be loaded by the offloading connector."""
        req_id = self._engine.facts(request).req_id
        if req_id in self.preempted:
            self.forget(req_id)
            self.modes["offload" if num_external_tokens else "recompute"] += 1

    def forget(self, req_id: str) -> None:
        self.preempted.pop(req_id, None)
        self.recompute.discard(req_id)

    def swapped(self) -> list[tuple[str, int]]:
        """(req_id, blocks) of the victims waiting to reload from the offload tier."""
        return [(req_id, num_blocks) for req_id, num_blocks in self.preempted.items()
                if req_id not in self.recompute]
