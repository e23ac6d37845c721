"""Event-loop stalls from the pool-wide ledger: `python -m kvquota_lab.perf.sidecar pool-store`.

No store call should hold up a sidecar's event loop: while one request waits on the
store (a charge, a take-back that waits for the others to lean, a release written
through, a refresh), every other request of every tenant keeps being served. This
drives `--engines` sidecars' admission in one event loop, wired as the sidecar wires it
(`PoolLink` builds the store and the pool-wide admission from a policy naming the
store; a pump per engine woken by releases and by the store's answers; the link's own
refresh loop), against a real redis-server this starts on a free port. One tenant with a
pool-wide guarantee sends most of its requests to engine 0, so it borrows the others'
shares through the store (charges, take-backs) and gives them back (releases).

Measured on the event loop's thread, for every call the loop makes into admission (a
request's submit, a pump, a release, the link's refresh):
- its store wait: the time the loop's thread spent in a socket call or on a lock made
  from the ledger's code or its Redis client (a profile hook on that thread alone,
  `sys.setprofile`): the store's round trips and the ledger's locks. A stall from the
  store is a call whose store wait passes 1 ms. A lock tried without waiting can still
  read above 1 ms when the interpreter hands the loop's thread over to another one
  right then (the GIL; printed by where it happened);
- its wall time, which also holds the machine's other load (2 shared cores here), and a
  heartbeat that asks to wake every millisecond: how late it woke, from all causes.
Printed: calls, stalls above 1 ms, p99 and max, and what the store was asked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any

from kvquota_lab.percentile import percentile
from kvquota_lab.processes import free_port

STALL_S = 0.001
_LOCKS = {"lock", "RLock", "_RLock"}
_STORE_CODE = "/gateway/pool/"
_CLIENT_CODE = "/redis/"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("pool-store", help="event-loop stalls from the pool-wide ledger",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=400.0, help="arrivals per second")
    parser.add_argument("--hold-ms", type=float, default=60.0,
                        help="mean time an admitted request holds its blocks")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-ms", type=float, default=5.0,
                        help="the store's timeout (the policy's poolStore.timeoutMs)")
    parser.set_defaults(func=_run)


@contextmanager
def _redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvq-pool-perf-") as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            client.close()
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def _in_store(frame: Any, depth: int = 8) -> bool:
    """Whether the call is the store's: made from the ledger's code or its client."""
    while frame is not None and depth > 0:
        name = frame.f_code.co_filename
        if _STORE_CODE in name or _CLIENT_CODE in name:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _policy(address: str, timeout_ms: float, engines: int) -> Any:
    from engine_sidecar.contract.policy import EnginePolicy

    def tenant(name: str, tier: str, priority: int, guaranteed: int, max_blocks: int) -> dict:
        return {"tenant_id": name, "tier": tier, "priority": priority,
                "guaranteed_blocks": guaranteed // engines,
                "maxBlocks": max_blocks // engines, "max_tokens": 256,
                "default_max_tokens": 256, "max_queue_seconds": 2.0,
                "max_queued_requests": 1000,
                "pool_wide": {"guaranteed_blocks": guaranteed, "max_blocks": max_blocks}}

    return EnginePolicy.model_validate({
        "pool": "bench/pool", "model": "bench", "block_size": 32, "watermark": 0.1,
        "capacity_blocks": 4000,
        "auth": {"jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"],
                         "audience": "bench", "issuer": "bench"}},
        "pool_store": {"address": address, "ttl_seconds": 2.0, "timeout_ms": timeout_ms},
        "tenants": {"hot": tenant("hot", "premium", 0, 1600, 3200),
                    "calm": tenant("calm", "free", 2, 400, 1600)},
    }).with_version()


class _Timings:
    """Wall time and store wait of each call into admission, on the loop's thread."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self.waits: dict[str, list[float]] = {}
        self._waited = 0.0
        self._blocked_at: float | None = None
        self._blocked_on = ""
        self.long: dict[str, int] = {}  # waits above 1 ms, by what was waited on

    def hook(self, _frame: Any, event: str, arg: Any) -> None:
        """`sys.setprofile` on the loop's thread: time spent in blocking socket calls and
        lock waits (what a store round trip or a lock held across one costs the loop)."""
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            if (isinstance(owner, socket.socket) or type(owner).__name__ in _LOCKS) and (
                    _in_store(_frame)):
                self._blocked_at = time.perf_counter()
                self._blocked_on = f"{type(owner).__name__} in {_frame.f_code.co_qualname}"
        elif event in ("c_return", "c_exception") and self._blocked_at is not None:
            waited = time.perf_counter() - self._blocked_at
            self._waited += waited
            if waited > STALL_S:
                self.long[self._blocked_on] = self.long.get(self._blocked_on, 0) + 1
            self._blocked_at = None

    def reset(self) -> None:
        self.calls.clear()
        self.waits.clear()
        self.long.clear()

    def timed(self, what: str, call: Callable[[], Any]) -> Any:
        waited = self._waited
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.calls.setdefault(what, []).append(time.perf_counter() - start)
            self.waits.setdefault(what, []).append(self._waited - waited)


async def _drive(args: argparse.Namespace, address: str) -> dict[str, Any]:
    from engine_sidecar.gateway.admission.ledger import Ledger
    from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
    from engine_sidecar.gateway.admission.rules import RequestShape
    from engine_sidecar.gateway.pool.link import PoolLink

    policy = _policy(address, args.timeout_ms, args.engines)
    rng = random.Random(args.seed)
    timings = _Timings()
    sys.setprofile(timings.hook)  # this thread only: the event loop's
    engines: list[tuple[AdmissionQueue, PoolLink, asyncio.Event]] = []
    tasks: list[asyncio.Task[Any]] = []
    for n in range(args.engines):
        changed = asyncio.Event()
        ledger = Ledger()
        queue = AdmissionQueue(ledger, clock=time.monotonic, rng=random.Random(n),
                               max_model_len=lambda: None)

        def released(reservation: Any, queue: AdmissionQueue = queue,
                     changed: asyncio.Event = changed) -> None:
            queue.released(reservation.tenant_id)
            changed.set()

        ledger.on_release = released
        queue.set_policy(policy)
        link = PoolLink(None, f"engine-{n}")
        link.wake = changed.set  # the store's answers wake the pump, as the Admitter does
        queue.pool = link.for_policy(policy)
        engines.append((queue, link, changed))

        async def pump(queue: AdmissionQueue = queue, changed: asyncio.Event = changed) -> None:
            while True:
                with suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.005)
                changed.clear()
                timings.timed("pump", queue.pump)

        async def refresh(queue: AdmissionQueue = queue, link: PoolLink = link) -> None:
            # The link's loop, timed per refresh: as `PoolLink.run` does it.
            while True:
                admission = link.for_policy(policy)
                if admission is not None:
                    timings.timed("refresh", partial(admission.refresh, policy, queue.view()))
                await asyncio.sleep(policy.pool_store.ttl_seconds / 3)

        tasks += [asyncio.create_task(pump()), asyncio.create_task(refresh())]

    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(STALL_S)
            lags.append(time.perf_counter() - start - STALL_S)

    tasks.append(asyncio.create_task(heartbeat()))
    await asyncio.sleep(policy.pool_store.ttl_seconds * 1.2)  # the new store's grace

    outcomes = {"admitted": 0, "refused": 0}

    async def one(engine: int, tenant: str, shape: RequestShape, hold: float) -> None:
        queue, _link, changed = engines[engine]
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket: Ticket = timings.timed("submit", lambda: queue.submit(tenant, shape))
        if not ticket.settled:
            def wake(_ticket: Ticket) -> None:
                if not settled.done():
                    settled.set_result(None)

            ticket.on_settled = wake
            changed.set()
            await settled
        if ticket.reservation is None:
            outcomes["refused"] += 1
            return
        outcomes["admitted"] += 1
        await asyncio.sleep(hold)
        reservation = ticket.reservation
        timings.timed("release", lambda: reservation.release("completed"))

    requests: list[asyncio.Task[None]] = []
    lags.clear()
    timings.reset()  # the connection and the threads' start are behind us
    started = time.perf_counter()
    for _ in range(args.requests):
        await asyncio.sleep(rng.expovariate(args.rate))
        tenant = "hot" if rng.random() < 0.7 else "calm"
        engine = 0 if rng.random() < 0.6 else rng.randrange(args.engines)
        shape = RequestShape((rng.randint(200, 3000),), 1)
        hold = rng.expovariate(1000.0 / args.hold_ms)
        requests.append(asyncio.create_task(one(engine, tenant, shape, hold)))
    await asyncio.gather(*requests)
    elapsed = time.perf_counter() - started
    for task in tasks:
        task.cancel()
    charges: dict[str, int] = {}
    for _queue, link, _changed in engines:
        if link.admission is not None:
            for outcome, count in link.admission.charges.items():
                charges[str(outcome)] = charges.get(str(outcome), 0) + count
        link.close()
    sys.setprofile(None)
    return {"timings": timings.calls, "waits": timings.waits, "long": timings.long,
            "lags": lags, "outcomes": outcomes, "charges": charges, "seconds": elapsed}


def _row(name: str, samples: list[float]) -> str:
    stalls = sum(s > STALL_S for s in samples)
    p99 = percentile(samples, 99) or 0.0
    return (f"{name:<10} {len(samples):>7} {stalls:>13} {p99 * 1e3:>9.3f} "
            f"{max(samples, default=0.0) * 1e3:>9.3f}")


def _run(args: argparse.Namespace) -> int:
    with _redis_server() as address:
        result = asyncio.run(_drive(args, address))
    print(f"{args.engines} engines, {args.requests} requests in {result['seconds']:.1f} s; "
          f"{result['outcomes']}; the store's answers: {result['charges']}")
    for title, calls in (("store wait", result["waits"]), ("wall time", result["timings"])):
        print(f"{title:<10} {'calls':>7} {'above 1 ms':>13} {'p99 ms':>9} {'max ms':>9}")
        every: list[float] = []
        for name in ("submit", "pump", "release", "refresh"):
            samples = calls.get(name, [])
            every += samples
            print(_row(name, samples))
        print(_row("all", every))
    print(_row("heartbeat", result["lags"]) + "   (lateness of a 1 ms sleep: all causes)")
    print(f"waits above 1 ms on the loop's thread, by what it waited on: {result['long']}")
    return 0
