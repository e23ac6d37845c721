"""Take a process's startup objects out of the garbage collector's view, until exit.

Importing transformers brings some 350,000 long-lived objects (torch, Triton) that
every full collection walks, stalling every request in flight at once. So a process
that serves requests or measures latency freezes them once after startup; its own
garbage is still collected, in fewer and larger collections (`THRESHOLDS`).

The freeze is undone at exit (`atexit` runs before the interpreter's last collections),
so nanobind's leak check (Triton's bindings) finds every object freed and prints no
false `nanobind: leaked ...` lines. Nothing is filtered from stderr.
"""

from __future__ import annotations

import atexit
import gc

# The youngest generation is collected after 10,000 net allocations of containers, not
# CPython's 700. Streaming allocates a few objects per chunk and frees nearly all of them
# by reference count, so the collections find little; each one stalls every stream in
# flight. A/B at 256 streams (docs/gateway.md): short prompts, from ~115 collections a
# run (gen0 max 1-2 ms, gen1 up to 7.6, a gen2 up to 18 ms of CPU) to 3-6 (gen0 max
# 4.5-7.6 ms), 67 ms of the loop's CPU to 14; 2.5k-token chats, 177 to 7, 90 ms to 41,
# the largest pause about as before (gen0 9-11 ms, was a gen2 of 9-18). The older
# generations keep CPython's ratios.
THRESHOLDS = (10_000, 20, 10)


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is left until the interpreter exits; collect what
    is made from then on at `THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    # Once per process, however often this is called (a second freeze is cheap).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
