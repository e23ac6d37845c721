"""What the tenant rules need of the engine they steer, as a protocol with no vLLM in it.

The parts of the plugin (leases, reclaim, prefill order, retention, stats) see the
engine only through `Engine`: `vllm_engine.VllmEngine` implements it over vLLM's
private scheduler API, and the rule tests run on an in-memory one
(tests/plugin/fake_engine.py). Requests and blocks are the engine's own handles,
opaque to the parts: what a rule reads of a request comes from `facts` and `phase`;
blocks go back to the engine, which alone knows who else holds them. What does not
change while the engine runs is given at construction (`EngineFacts`), not asked.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, NamedTuple, Protocol

Request = Any  # the engine's request, opaque to the parts
Block = Any  # the engine's KV block, opaque to the parts


class Phase(Enum):
    """Where a request is in the engine, as the rules tell them apart."""

    QUEUED = auto()  # waits for its first or next admission
    PENDING = auto()  # waits on something else first (a grammar, remote KV)
    RUNNING = auto()
    FINISHED = auto()  # its cached KV is worth leasing
    DISCARDED = auto()  # finished with an error or ignored: nothing to lease


class RequestFacts(NamedTuple):
    """What the rules read of a request, as of now."""

    req_id: str
    priority: int
    num_computed_tokens: int
    arrival_time: float
    num_prompt_tokens: int
    num_preemptions: int
    extra_args: Mapping[str, Any] | None  # the sidecar's `vllm_xargs`


# One running request as victim ranking reads it (`Engine.scan_running`): (request,
# req_id, tenant known to the policy or None, its own priority (a victim mark left
# out), computed tokens, arrival time). A plain tuple: one is built per running request.
RunningEntry = tuple[Request, str, str | None, int, int, float]


@dataclass(frozen=True)
class EngineFacts:
    """What the engine is, for its lifetime."""

    block_size: int
    num_blocks: int  # allocatable KV blocks
    steer_victims: bool  # the plugin picks the victims (vLLM's priority policy)
    offloading: bool  # a connector stores preempted work's KV to reload it
    vllm_version: str


class Engine(Protocol):
    # -- requests
    def facts(self, request: Request) -> RequestFacts: ...
    def phase(self, request: Request) -> Phase: ...
    def get_request(self, req_id: str) -> Request | None: ...
    def running(self) -> list[Request]: ...
    def all_requests(self) -> Iterable[Request]: ...
    def has_unfinished_requests(self) -> bool: ...

    # -- KV blocks: who holds what, leases' references
    def free_block_count(self) -> int: ...
    def block_id(self, block: Block) -> int: ...
    def request_blocks(self, req_id: str) -> list[Block]: ...
    def cached_blocks(self, req_id: str) -> list[Block]: ...
    def num_blocks_held(self, req_id: str) -> int: ...
    def pin_blocks(self, blocks: list[Block]) -> None: ...
    def unpin_blocks(self, blocks: list[Block]) -> None: ...
    def scan_running(
        self, identities: Mapping[str, Any], known_tenants: Container[str],
        marked: Mapping[str, tuple[Any, int]],
    ) -> tuple[list[RunningEntry], dict[str | None, int], dict[str | None, set[int]]]: ...
    def count_unshared_blocks(self, blocks: list[Block], shared_ids: set[int]) -> int: ...
    def count_lease_only_blocks(
        self, blocks: list[Block], running_shared: Container[int], counted: set[int]
    ) -> int: ...

    # -- steering: the victim, the next step, the eviction order
    def mark_victim(self, request: Request) -> int: ...
    def restore_priority(self, request: Request, priority: int) -> None: ...
    def preempt_between_steps(self, request: Request) -> None: ...
    def step_growth_blocks(self) -> int: ...
    def prefilling(self) -> Collection[Request]: ...
    def next_waiting(self) -> Request | None: ...
    def skip_next_step(self, request: Request) -> None: ...
    def next_evicted_block_id(self) -> int | None: ...
    def evict_first(self, blocks: Iterable[Block]) -> None: ...
