"""Wire formats between the engine-side parts and the operator.

- `EngineStats`: what the scheduler plugin (EngineCore process) publishes at
  `KVQUOTA_STATS_PATH`: a JSON file replaced atomically at least every `HEARTBEAT_S`
  while the engine runs. The sidecar reads it, and takes stats older than
  `STALE_AFTER_S` for unknown capacity (the engine is gone or stuck).
- `SidecarStatus`: what the sidecar serves at `GET /kvquota/status` on its admin port
  (container port `admin`, 9100 by default; never on the client port): the plugin's
  view merged with the admission ledger. The operator polls it and writes CR status.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class TenantEngineStats(_Wire):
    running_blocks: int = 0
    leased_blocks: int = 0
    leased_sessions: int = 0
    running: int = 0
    waiting: int = 0
    preemptions: dict[str, int] = Field(default_factory=dict, description="by reason")
    outgrown_preemptions: int = Field(
        0, description="running requests preempted while holding more blocks than the "
        "sidecar reserved for them (they had decoded past their output estimate); "
        "counted within `preemptions` too"
    )
    lease_breaks: int = 0
    degraded_events: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    swapped_blocks: int = Field(
        0, description="blocks held by preempted requests waiting to reload from the KV "
        "offload tier (victims of at least recomputeBelowBlocks blocks); 0 without "
        "offloading. Exported as vllm_tenant_active_swapped_blocks."
    )
    lease_drops: dict[str, int] = Field(
        default_factory=dict,
        description="leases ended without memory pressure, by reason (expired, cap, policy, "
        "reset); not evictions",
    )
    pinned_blocks: int = Field(
        0, description="distinct blocks the tenant's leases pin, including those a running "
        "request shares (leasedBlocks counts only the ones no running request holds)"
    )
    leases: dict[str, int] = Field(
        default_factory=dict,
        description="session id -> blocks its lease pins: admission leaves these out of the "
        "reservation of the session's next turn (it reuses them)",
    )
    idle_lease_block_seconds: float = Field(
        0.0, description="block-seconds leases pinned after their session's last activity "
        "without the session coming back: leases that ended (expired, capped, broken) "
        "before the next turn, and live leases of idle sessions so far"
    )

    @property
    def used_blocks(self) -> int:
        """Pinned blocks count as the tenant's usage."""
        return self.running_blocks + self.leased_blocks


class EngineStats(_Wire):
    timestamp: float = Field(description="time.time() when written")
    policy_version: str | None = None
    policy_error: str | None = None
    total_blocks: int = 0
    free_blocks: int = 0
    preemption_mode: str = Field(
        "recompute", description="offload when the engine runs a KV offloading connector"
    )
    degraded: bool = False
    degraded_episodes: int = 0
    preemptions_by_mode: dict[str, int] = Field(
        default_factory=dict,
        description="preempted requests by how their KV came back: recompute / offload "
        "(reloaded from the KV offload tier). Without offloading every preemption counts "
        "as recompute; with it, a request counts when it resumes.",
    )
    vllm_version: str | None = None
    tenants: dict[str, TenantEngineStats] = Field(default_factory=dict)


class TenantCounters(_Wire):
    admitted: int = 0
    rejected_quota: int = 0
    rejected_watermark: int = 0
    preemptions: int = 0
    outgrown_preemptions: int = Field(
        0, description="preemptions of requests that held more than they reserved"
    )
    lease_breaks: int = 0
    degraded_events: int = 0


class TenantUsage(_Wire):
    blocks: int = Field(0, description="held in the engine: running requests + idle leases")
    reserved_blocks: int = Field(
        0, description="what admission reserved for the requests in flight: prompt + "
        "output estimate (max_tokens for a Full tier)"
    )
    pending_blocks: int = Field(
        0, description="reserved for work not allocated yet: reservations beyond what the "
        "tenant's running requests hold"
    )
    charged_blocks: int = Field(
        0, description="what counts against maxBlocks: the blocks its running requests hold "
        "plus pendingBlocks (the larger of reservedBlocks and the running blocks)"
    )
    output_estimate_tokens: int = Field(
        0, description="the output tokens a request of the tenant reserves now (learned, "
        "or the tier's defaultMaxTokens; maxTokens for a Full tier)"
    )
    above_max_blocks: int = Field(
        0, description="chargedBlocks beyond maxBlocks: work run in KV nobody else wanted "
        "(aboveMax: Reclaimable), the first to be preempted"
    )
    leased_blocks: int = 0
    leased_sessions: int = 0
    inflight: int = 0
    queued: int = Field(0, description="requests waiting in the sidecar's admission queue")
    queue_wait_seconds: float = Field(0.0, description="how long the oldest one has waited")


class TenantStatus(_Wire):
    usage: TenantUsage = TenantUsage()
    counters: TenantCounters = TenantCounters()


class SidecarStatus(_Wire):
    ready: bool
    policy_version: str | None = None
    policy_error: str | None = None
    total_blocks: int = 0
    free_blocks: int = 0
    degraded: bool = False
    pool_store_reachable: bool | None = Field(
        None, description="the pool-wide ledger's store answered the last round trip "
        "(False: admission keeps to what this sidecar had claimed); None: no store"
    )
    pool_store_problem: str | None = Field(
        None, description="why this sidecar does not use the store its policy names "
        "(its password is not mounted); poolStoreReachable is then False"
    )
    tenants: dict[str, TenantStatus] = Field(default_factory=dict)
    capacity_source: str | None = Field(
        None, description="where totalBlocks/freeBlocks come from: 'engine' (plugin stats), "
        "'policy' (capacityBlocks override); None: unknown, the watermark is not applied"
    )
    engine_stats_age_seconds: float | None = Field(
        None, description="age of the plugin's latest stats file; None: none read yet"
    )
    engine_stats_stale: bool = Field(
        False, description="the plugin's stats are older than STALE_AFTER_S: admission "
        "ignores them (unknown capacity) until the engine publishes again"
    )
