"""Policies, prompts and the plugin's published stats, for the scheduler-plugin tests."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy, LeasePolicy, TenantPolicy
from engine_sidecar.contract.stats import EngineStats

TIERS = {"premium": 0, "standard": 1, "free": 2}


def tenant(
    tenant_id: str,
    tier: str = "premium",
    *,
    guaranteed: int = 0,
    max_blocks: int = 100_000,
    lease_seconds: int = 0,
    lease_sessions: int = 0,
    lease_blocks: int = 0,
    above_max: str = "Reclaimable",
) -> TenantPolicy:
    return TenantPolicy(
        tenant_id=tenant_id,
        tier=tier,
        priority=TIERS[tier],
        guaranteed_blocks=guaranteed,
        max_blocks_per_engine=max(max_blocks, guaranteed),
        above_max=above_max,
        lease=LeasePolicy(seconds=lease_seconds, max_sessions=lease_sessions,
                          max_leased_blocks=lease_blocks),
        max_tokens=4096,
        default_max_tokens=64,
    )


def engine_policy(*tenants: TenantPolicy, block_size: int = 16, **pool: object) -> EnginePolicy:
    return EnginePolicy(
        pool="default/pool",
        model="tiny",
        block_size=block_size,
        tenants={t.tenant_id: t for t in tenants},
        **pool,  # type: ignore[arg-type]
    ).with_version()


def write_policy(path: Path, policy: EnginePolicy) -> None:
    write_atomically(path, policy.to_json())


class Tokens:
    """Deterministic random prompts (distinct prompts share no prefix blocks)."""

    def __init__(self, seed: int = 7) -> None:
        self._rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self._rng.randrange(16, 2000) for _ in range(n)]


def read_stats(path: Path) -> EngineStats | None:
    try:
        return EngineStats.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def wait_stats(
    path: Path, ready: Callable[[EngineStats], bool], timeout: float = 30.0
) -> EngineStats:
    """The first published stats for which `ready(stats)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = read_stats(path)
        if stats is not None and ready(stats):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"stats at {path} never matched; last: {read_stats(path)}")
