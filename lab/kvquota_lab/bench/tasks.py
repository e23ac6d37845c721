"""Runs a bench's (scenario, policy) tasks, on one engine or a pool, in parallel.

Each run is deterministic, so the results do not depend on how many worker processes
share them; the pool runs (`bench.pool`) and the single-engine runs (`bench.twin`)
meet here, so neither imports the other.
"""

from __future__ import annotations

from typing import Any

from kvquota_lab.bench.cost import CostProfile
from kvquota_lab.bench.metrics import RunResult
from kvquota_lab.bench.policies import PolicySpec
from kvquota_lab.bench.pool import PoolSpec, run_pool
from kvquota_lab.bench.scenario import Scenario, generate_sessions
from kvquota_lab.bench.twin import Progress, run_twin

# (scenario, policy) on one engine, or (scenario, policy, pool) on a pool of them.
TwinTask = tuple[Scenario, PolicySpec] | tuple[Scenario, PolicySpec, PoolSpec]
_worker_queue: Any = None


def quiet_vllm_logs() -> None:
    """Keep vLLM's config-time notices (CPU platform, block size) out of bench output."""
    import logging

    import vllm  # noqa: F401  (vLLM configures its logger on import)

    logging.getLogger("vllm").setLevel(logging.ERROR)


def _init_worker(queue: Any, quiet: bool) -> None:
    global _worker_queue
    _worker_queue = queue
    if quiet:
        quiet_vllm_logs()


def _report(key: str, settled: int, planned: int, virtual: float) -> None:
    if _worker_queue is not None:
        _worker_queue.put((key, settled, planned, virtual))


def _run_one(task: TwinTask, profile: CostProfile, progress: Progress | None) -> RunResult:
    if len(task) == 3:
        return run_pool(task[0], task[1], task[2], profile, progress)
    scenario, spec = task
    return run_twin(scenario, generate_sessions(scenario), spec, profile, progress)


def _run_task(task: TwinTask, profile: CostProfile) -> RunResult:
    return _run_one(task, profile, _report)


def run_twin_tasks(
    tasks: list[TwinTask], profile: CostProfile, *, jobs: int = 1,
    progress: Progress | None = None, quiet: bool = False,
) -> list[RunResult]:
    """Run each (scenario, policy) on its own scheduler; results in task order.

    With `jobs` > 1 the runs go to that many worker processes (spawned: each imports
    vLLM once); each run is still deterministic, so the results do not depend on
    `jobs`. KVQuota runs, the slowest, are started first."""
    if jobs <= 1 or len(tasks) <= 1:
        if quiet:
            quiet_vllm_logs()
        return [_run_one(task, profile, progress) for task in tasks]
    import multiprocessing
    import queue as queue_module
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("spawn")
    updates = context.Queue()
    order = sorted(range(len(tasks)), key=lambda i: tasks[i][1].scheduler != "kvquota")
    with ProcessPoolExecutor(
        max_workers=min(jobs, len(tasks)), mp_context=context,
        initializer=_init_worker, initargs=(updates, quiet),
    ) as pool:
        futures = {i: pool.submit(_run_task, tasks[i], profile) for i in order}
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            while True:
                try:
                    update = updates.get_nowait()
                except queue_module.Empty:
                    break
                if progress is not None:
                    progress(*update)
            for future in done:
                result = future.result()  # a worker's exception surfaces here
                if progress is not None:
                    planned = len(result.outcomes)
                    progress(result.key, planned, planned, result.makespan)
        return [futures[i].result() for i in range(len(tasks))]
