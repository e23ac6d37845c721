"""An engine in memory, for the rule tests: `engine_port.Engine` without vLLM.

It keeps what the rules read and steer -- requests with a phase, a priority and the
blocks they hold; blocks with reference counts; a free queue, first evicted first --
and none of a scheduler's policy. A test plays vLLM's part with the helpers below:
`add`, `preempt` and `finish` call the plugin's hooks where vLLM's scheduler does,
`allocate` fails the way vLLM's KV cache manager does (and calls the plugin's
handler), `preempt` takes vLLM's priority-policy victim. tests/plugin's scheduler
tests prove the same rules on vLLM itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_sidecar.contract.names import SESSION_ARG, TENANT_ARG
from engine_sidecar.plugin.config import PluginConfig
from engine_sidecar.plugin.core.engine_port import EngineFacts, Phase, RequestFacts, RunningEntry
from engine_sidecar.plugin.core.tenant_plugin import TenantPlugin

MARKED_PRIORITY = 1_000_000  # above any tier: what `mark_victim` gives the victim


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    cached: bool = False  # a full block of some prefix, reusable until evicted


@dataclass(eq=False)
class FakeRequest:
    req_id: str
    num_prompt_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    extra_args: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    phase: Phase = Phase.QUEUED
    blocks: list[FakeBlock] = field(default_factory=list)


class FakeEngine:
    """`engine_port.Engine` over plain lists; block 0 and up are all allocatable."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.block_size = block_size
        self.blocks = [FakeBlock(i) for i in range(num_blocks)]
        self.free = list(self.blocks)  # the next allocation takes free[0]
        self.requests: dict[str, FakeRequest] = {}
        self.running_requests: list[FakeRequest] = []
        self.growth = 0  # what `step_growth_blocks` says
        self.skipped: list[str] = []  # req_ids `skip_next_step` held back
        self.preempted: list[str] = []  # req_ids, in the order they were preempted
        self._plugin: TenantPlugin | None = None

    def build_plugin(self, config: PluginConfig, *, steer_victims: bool = True) -> TenantPlugin:
        """The plugin over this engine, its hooks called as vLLM's scheduler calls them."""
        facts = EngineFacts(block_size=self.block_size, num_blocks=len(self.blocks),
                            steer_victims=steer_victims, offloading=False,
                            vllm_version="fake")
        self._plugin = TenantPlugin(self, config, facts)
        return self._plugin

    @property
    def plugin(self) -> TenantPlugin:
        assert self._plugin is not None, "build_plugin first"
        return self._plugin

    # -- playing vLLM's part ------------------------------------------------------------

    def add(self, req_id: str, *, tenant: str | None = None,
            session: str | None = None, prompt_blocks: int = 1, priority: int = 0,
            arrival_time: float = 0.0, extra_args: Mapping[str, Any] | None = None,
            ) -> FakeRequest:
        """A new request, through the plugin's `request_added` as vLLM's add_request."""
        extra_args = dict(extra_args or {})
        if tenant is not None:
            extra_args[TENANT_ARG] = tenant
        if session is not None:
            extra_args[SESSION_ARG] = session
        request = FakeRequest(req_id, prompt_blocks * self.block_size, priority,
                              arrival_time, extra_args or None)
        self.plugin.request_added(request)
        self.requests[req_id] = request
        return request

    def allocate(self, request: FakeRequest, num_blocks: int, *,
                 prefix: Iterable[FakeBlock] = (), on_failure: Callable[..., Any] | None = None,
                 ) -> list[FakeBlock] | None:
        """Give `request` the blocks of `prefix` (a cache hit) and `num_blocks` new
        ones, or none: on failure `on_failure(request, retry, shortfall)` decides, as
        the plugin's allocation hook does in vLLM. A request that gets blocks runs."""
        hit = list(prefix)

        def attempt() -> list[FakeBlock] | None:
            if len(self.free) - sum(block.ref_cnt == 0 for block in hit) < num_blocks:
                return None
            self.pin_blocks(hit)
            new = [self.free.pop(0) for _ in range(num_blocks)]
            for block in new:
                block.ref_cnt, block.cached = 1, True
            request.blocks += hit + new
            request.num_computed_tokens = len(request.blocks) * self.block_size
            if request.phase is not Phase.RUNNING:
                request.phase = Phase.RUNNING
                self.running_requests.append(request)
            return new

        got = attempt()
        if got is None and on_failure is not None:
            got = on_failure(request, attempt, lambda: num_blocks - len(self.free))
        return got

    def preempt(self, request: FakeRequest | None = None) -> FakeRequest:
        """Preempt `request`, else vLLM's priority-policy victim (the largest
        (priority, arrival)), through the plugin's `preempting` hook."""
        if request is None:
            request = max(self.running_requests, key=lambda r: (r.priority, r.arrival_time))
        self.plugin.preempting(request)
        self.running_requests.remove(request)
        self._release(request)
        request.phase = Phase.QUEUED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.preempted.append(request.req_id)
        return request

    def finish(self, request: FakeRequest, phase: Phase = Phase.FINISHED) -> None:
        """The request is done: the plugin's hooks around freeing its blocks."""
        if request in self.running_requests:
            self.running_requests.remove(request)
        request.phase = phase
        freed = self.plugin.request_finishing(request)
        self._release(request)
        del self.requests[request.req_id]
        self.plugin.request_freed(freed)

    def _release(self, request: FakeRequest) -> None:
        self.unpin_blocks(request.blocks)
        request.blocks = []

    # -- engine_port.Engine ---------------------------------------------------------------

    def facts(self, request: FakeRequest) -> RequestFacts:
        return RequestFacts(request.req_id, request.priority, request.num_computed_tokens,
                            request.arrival_time, request.num_prompt_tokens,
                            request.num_preemptions, request.extra_args)

    def phase(self, request: FakeRequest) -> Phase:
        return request.phase

    def get_request(self, req_id: str) -> FakeRequest | None:
        return self.requests.get(req_id)

    def running(self) -> list[FakeRequest]:
        return self.running_requests

    def all_requests(self) -> Iterable[FakeRequest]:
        return self.requests.values()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def free_block_count(self) -> int:
        return len(self.free)

    def block_id(self, block: FakeBlock) -> int:
        return block.block_id

    def request_blocks(self, req_id: str) -> list[FakeBlock]:
        request = self.requests.get(req_id)
        return list(request.blocks) if request is not None else []

    def cached_blocks(self, req_id: str) -> list[FakeBlock]:
        return [block for block in self.request_blocks(req_id) if block.cached]

    def num_blocks_held(self, req_id: str) -> int:
        return len(self.request_blocks(req_id))

    def pin_blocks(self, blocks: list[FakeBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1

    def unpin_blocks(self, blocks: list[FakeBlock]) -> None:
        # The tail of a prefix goes back first, so it is evicted first (as in vLLM).
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.append(block)

    def scan_running(
        self, identities: Mapping[str, Any], known_tenants: Container[str],
        marked: Mapping[str, tuple[Any, int]],
    ) -> tuple[list[RunningEntry], dict[str | None, int], dict[str | None, set[int]]]:
        entries: list[RunningEntry] = []
        unshared: dict[str | None, int] = {}
        shared: dict[str | None, set[int]] = {}
        for request in self.running_requests:
            identity = identities.get(request.req_id)
            tenant = identity.tenant if identity is not None else None
            tenant = tenant if tenant in known_tenants else None
            priority = marked[request.req_id][1] if request.req_id in marked else request.priority
            entries.append((request, request.req_id, tenant, priority,
                            request.num_computed_tokens, request.arrival_time))
            held = self.count_unshared_blocks(request.blocks, shared.setdefault(tenant, set()))
            unshared[tenant] = unshared.get(tenant, 0) + held
        return entries, unshared, shared

    def count_unshared_blocks(self, blocks: list[FakeBlock], shared_ids: set[int]) -> int:
        shared_here = {block.block_id for block in blocks if block.ref_cnt > 1}
        shared_ids |= shared_here
        return len(blocks) - len(shared_here)

    def count_lease_only_blocks(self, blocks: list[FakeBlock], running_shared: Container[int],
                                counted: set[int]) -> int:
        mine = [block.block_id for block in blocks
                if block.ref_cnt == 1 or block.block_id not in running_shared]
        num_new = sum(1 for block_id in mine if block_id not in counted)
        counted.update(block_id for block_id in mine if block_id not in counted)
        return num_new

    def mark_victim(self, request: FakeRequest) -> int:
        assert request.phase is Phase.RUNNING
        original, request.priority = request.priority, MARKED_PRIORITY
        return original

    def restore_priority(self, request: FakeRequest, priority: int) -> None:
        request.priority = priority

    def preempt_between_steps(self, request: FakeRequest) -> None:
        self.preempt(request)

    def step_growth_blocks(self) -> int:
        return self.growth

    def prefilling(self) -> Collection[FakeRequest]:
        return [request for request in self.running_requests
                if request.num_computed_tokens < request.num_prompt_tokens]

    def next_waiting(self) -> FakeRequest | None:
        queued = [request for request in self.requests.values() if request.phase is Phase.QUEUED]
        return min(queued, key=lambda r: (r.priority, r.arrival_time), default=None)

    def skip_next_step(self, request: FakeRequest) -> None:
        self.skipped.append(request.req_id)

    def next_evicted_block_id(self) -> int | None:
        return next((block.block_id for block in self.free if block.cached), None)

    def evict_first(self, blocks: Iterable[FakeBlock]) -> None:
        moved = [block for block in blocks if block.ref_cnt == 0]
        self.free = moved + [block for block in self.free if block not in moved]
