"""A pool's router by name: the models in `routers`, or llm-d Router running the
shipped picker configuration (`picker_router`)."""

from __future__ import annotations

from kvquota_lab.bench.picker_config import PickerConfig
from kvquota_lab.bench.picker_router import ConfiguredPicker
from kvquota_lab.bench.routers import (
    LeastKv,
    PrefixAffinity,
    RoundRobin,
    Router,
    SessionAffinity,
)

ROUTERS = ("round-robin", "least-kv", "prefix-affinity", "session-affinity")


def make_router(name: str, engines: int, *, block_size: int, capacity_blocks: int,
                model: str, kv_filter: float | None = None,
                config: PickerConfig | None = None) -> Router:
    """With `config`, `prefix-affinity` is llm-d Router running it (`picker_router`);
    without, the model of the pickers' stock scorers on vLLM's series (`PrefixAffinity`)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-kv":
        return LeastKv()
    if name == "prefix-affinity":
        if config is not None:
            if kv_filter is not None:
                config = config.with_threshold(kv_filter)
            return ConfiguredPicker(config, engines, block_size=block_size,
                                    capacity_blocks=capacity_blocks, model=model)
        return PrefixAffinity(engines, block_size=block_size,
                              capacity_blocks=capacity_blocks, model=model, kv_filter=kv_filter)
    if name == "session-affinity":
        return SessionAffinity()
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
