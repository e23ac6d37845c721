"""TenantAwareScheduler: vLLM V1 scheduler plugin (placeholder; grows in issue 3)."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler


class TenantAwareScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
