"""Prefill order: higher tiers' prefills get the step's token budget first.

vLLM schedules running requests in `running` order, prefill chunks included, and
waiting requests only with what is left, and a step lasts as long as its largest
prefill: a premium request would wait behind free-tier chunks, and its last chunk
would share its step with them. So while a higher-priority request prefills, or waits
to be admitted, lower-priority prefill chunks sit out the step (decodes always run).
"""

from __future__ import annotations

from engine_sidecar.plugin.core.engine_port import Engine, Request


def prioritize_prefills(engine: Engine, stuck: Request | None) -> None:
    """Leave lower-priority prefill chunks out of the next step. `stuck` is a waiting
    request that could not be given room: it does not hold the others back (it would
    only waste the budget)."""
    prefilling = engine.prefilling()
    if not prefilling:
        return
    top = engine.next_waiting()
    priorities = [engine.facts(request).priority for request in prefilling]
    bound = min(priorities)
    if top is not None and top is not stuck:
        bound = min(bound, engine.facts(top).priority)
    for request, priority in zip(prefilling, priorities, strict=True):
        if priority > bound:
            engine.skip_next_step(request)
