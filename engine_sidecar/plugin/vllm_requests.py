"""vLLM's requests and step, as the plugin's parts see them (`engine_port.Engine`).

What the parts read of a request (its facts and phase) and how they
steer the next step (mark a victim, preempt between steps, hold a prefill chunk back)
all touch vLLM's private scheduler API, so all of it is here; `vllm_engine` adds the
KV blocks. docs/scheduler-plugin.md lists every touchpoint.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from engine_sidecar.plugin.core.engine_port import Phase, RequestFacts

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

# Far above any real priority: the running request vLLM must pick as its victim.
VICTIM_PRIORITY = 1 << 62
_NO_LEASE_STATUSES = frozenset({RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_IGNORED})
_QUEUED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class VllmRequests:
    """The request half of `engine_port.Engine` over one vLLM scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    # -- requests ------------------------------------------------------------------------

    def facts(self, request: Request) -> RequestFacts:
        params = request.sampling_params
        return RequestFacts(
            request.request_id, request.priority, request.num_computed_tokens,
            request.arrival_time, request.num_prompt_tokens, request.num_preemptions,
            params.extra_args if params is not None else None,
        )

    def phase(self, request: Request) -> Phase:
        status = request.status
        if status == RequestStatus.RUNNING:
            return Phase.RUNNING
        if status in _QUEUED_STATUSES:
            # Still the engine's: not aborted and replaced under the same id.
            if self._scheduler.requests.get(request.request_id) is request:
                return Phase.QUEUED
            return Phase.PENDING
        if status < RequestStatus.RUNNING:
            return Phase.PENDING
        if status in _NO_LEASE_STATUSES:
            return Phase.DISCARDED
        return Phase.FINISHED

    def mark_victim(self, request: Request) -> int:
        """Make a running request vLLM's next priority-policy victim; returns the priority
        to restore. Only ever called on a request in `running`, never one in a heap."""
        assert request.status == RequestStatus.RUNNING
        original = int(request.priority)
        request.priority = VICTIM_PRIORITY
        return original

    def restore_priority(self, request: Request, priority: int) -> None:
        request.priority = priority

    def running(self) -> list[Request]:
        return self._scheduler.running

    def has_unfinished_requests(self) -> bool:
        return bool(self._scheduler.has_unfinished_requests())

    def all_requests(self) -> Iterable[Request]:
        return self._scheduler.requests.values()

    def get_request(self, req_id: str) -> Request | None:
        return self._scheduler.requests.get(req_id)

    # -- steering the next step -------------------------------------------------------

    def step_growth_blocks(self) -> int:
        """About how many blocks the running requests allocate in the next step: one for
        every decoding request whose next token starts a block, plus the chunk of every
        request still prefilling (bounded by the step's token budget)."""
        block_size = self._scheduler.block_size
        budget = self._scheduler.max_num_scheduled_tokens
        blocks = 0
        for request in self._scheduler.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining <= 1:
                blocks += request.num_computed_tokens % block_size == 0
            else:
                chunk = min(remaining, budget)
                budget -= chunk
                blocks += -(-chunk // block_size)
        return blocks


    def preempt_between_steps(self, request: Request) -> None:
        """Preempt a running request before `schedule()` (vLLM does the same for a prefix
        cache reset): out of `running`, blocks freed, back to the waiting queue, reported
        in the next step's `preempted_req_ids`. It may resume in that very step, so it must
        not count as scheduled in the last one (the model runner then gets its tokens)."""
        self._scheduler.running.remove(request)
        self._scheduler._preempt_request(
            request, time.monotonic(), drop_stale_output=self._scheduler.requires_kv_delivery
        )
        # vLLM 0.32-0.33 (Model Runner V1) only: 0.34 sends a resumed request in full.
        prev_scheduled = getattr(self._scheduler, "prev_step_scheduled_req_ids", None)
        if prev_scheduled is not None:
            prev_scheduled.discard(request.request_id)


    def next_waiting(self) -> Request | None:
        """The request vLLM tries to admit first in the next step (the heap's top under the
        priority policy), if any may still be admitted."""
        scheduler = self._scheduler
        if not scheduler.waiting or len(scheduler.running) >= scheduler.max_num_running_reqs:
            return None
        return scheduler.waiting.peek_request()


    def prefilling(self) -> Collection[Request]:
        """Running requests whose prompt is not fully computed (chunked prefill)."""
        return self._scheduler._inflight_prefills


    def skip_next_step(self, request: Request) -> None:
        """Leave a running request out of the next `schedule()` only (it keeps its blocks
        and its place). vLLM's own diffusion scheduler skips a step the same way:
        `schedule()` advances `current_step` before it checks eligibility."""
        request.next_decode_eligible_step = max(
            request.next_decode_eligible_step, self._scheduler.current_step + 2
        )
