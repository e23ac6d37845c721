"""The pool-wide ledger on a shared store (Redis or Valkey): what every engine's sidecar
has claimed of each tenant's pool-wide maxBlocks and maxConcurrentRequests.

Each sidecar writes only its own hash, under a TTL it refreshes, so a dead sidecar's
charges expire; the pool total is the sum over live sidecars. A claim is the more of
what a sidecar's requests hold (`b`, `r`) and its allowance (`ab`, `ar`): what it may
admit with no round trip. Every change that raises a claim is one Lua script (EVALSHA)
that writes only if the pool-wide limit allows, so two sidecars never both take the
last blocks. A refusal marks the tenant for one TTL, and every sidecar's refresh then
lowers its allowance to what it holds plus a margin. A charge that what the tenant
holds leaves room for, but the others' allowances block, asks them to lean (pub/sub)
and is retried for a few ms: nothing is granted above maxBlocks. After a store restart (a
new epoch) nothing grows for one TTL while sidecars republish. Keys share one hash tag
(`{pool}`), so a cluster keeps them on one slot. The protocol: docs/gateway.md (pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from engine_sidecar.gateway.pool import scripts

if TYPE_CHECKING:
    import redis

    from engine_sidecar.gateway.pool.worker import Runner

NO_LIMIT = -1
MARGIN_SHARE = 4  # under pressure an allowance keeps a quarter of its split free


def lean_margin(floor: int, ceiling: int) -> int:
    """What an allowance keeps above what its sidecar holds while another engine needs
    room: a quarter of its split, at least `floor`. Smaller margins lend more and cost
    a round trip on more admissions (twin, noisy-neighbour at 8 engines: 1 request of
    margin sent 56% of admissions to the store)."""
    return max(floor, ceiling // MARGIN_SHARE)


class Outcome(StrEnum):
    LOCAL = "local"  # within this sidecar's allowance: no round trip
    POOL = "pool"  # granted by the store
    REFUSED = "refused"  # the pool-wide total does not allow it
    FALLBACK = "fallback"  # store down or rebuilding: beyond what this sidecar claimed


@dataclass(frozen=True)
class Limits:
    """One tenant's limits: pool-wide (the store checks them) and this engine's share
    (the most this sidecar's allowance may grow to). None: no limit."""

    max_blocks: int
    ceiling_blocks: int
    max_requests: int | None = None
    ceiling_requests: int | None = None
    # Pool-wide guaranteed blocks (None: none). With a guarantee, a charge that what
    # the tenant holds leaves room for takes the others' unused allowances back.
    guaranteed_blocks: int | None = None


@dataclass
class Claim:
    """One sidecar's claim on one tenant: what its requests hold, and its allowance
    (what it may admit with no round trip)."""

    blocks: int = 0
    requests: int = 0
    allow_blocks: int = 0
    allow_requests: int = 0

    def allows(self, blocks: int, requests: int, limits: Limits) -> bool:
        """Whether `blocks` and `requests` more fit the allowance (no round trip)."""
        return self.blocks + blocks <= self.allow_blocks and (
            limits.max_requests is None or self.requests + requests <= self.allow_requests)

    def claimed(self) -> tuple[int, int]:
        """What the store counts against the pool-wide limits: the more of the two."""
        return max(self.blocks, self.allow_blocks), max(self.requests, self.allow_requests)

    def ended(self, blocks: int, requests: int, limits: Limits, pressured: bool) -> bool:
        """A request ended: its tenant's requests hold `blocks` and `requests` now. True
        when that must be written through at once: the claim was above the allowance
        (a store-granted charge the others' claims wait on) or the tenant is under
        pressure (a charge elsewhere is checked against what it holds)."""
        above = self.blocks > self.allow_blocks or (
            limits.max_requests is not None and self.requests > self.allow_requests)
        self.blocks, self.requests = max(0, blocks), max(0, requests)
        return above or pressured


class PoolStore:
    """One sidecar's side of the pool-wide ledger. Thread-safe: the claims sit under a
    lock held only to read or write them, never across a round trip, so the event loop
    that reads them (`allows`, `take`, `sync`) never waits on the store; round trips
    hold a second lock, one at a time. `io`: where the round trips that nobody waits
    on run (a release written through, a refresh): the sidecar's store thread; None,
    in the caller (the tests that step a queue by hand)."""

    def __init__(self, client: redis.Redis, pool: str, sidecar: str, *,
                 ttl_s: float = 10.0, margin_blocks: int = 16, margin_requests: int = 1,
                 take_back_s: float = 0.005, io: Runner | None = None) -> None:
        self._client = client
        self._prefix = f"kvq:{{{pool}}}:c:"
        self._channel = f"kvq:{{{pool}}}:lean"
        # How long a charge the others' allowances block waits for them to lean.
        self.take_back_s = take_back_s
        self._listening: threading.Event | None = None
        self.subscribed = threading.Event()  # set while listening for requests to lean
        self._keys = [f"kvq:{{{pool}}}:live", self._prefix + sidecar, f"kvq:{{{pool}}}:epoch"]
        self._me = sidecar
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._margin = (margin_blocks, margin_requests)
        self._claims: dict[str, Claim] = {}
        self._limits: dict[str, Limits] = {}
        self._lock = threading.Lock()  # the claims: held for reads and writes only
        # Tenants with a charge on its way to the store: nothing of theirs is admitted
        # locally meanwhile, so the claim the store answers on is the whole claim.
        self._charging: dict[str, int] = {}
        # A refresh on its way: its allowances replace those local admissions were
        # checked against, so none is admitted locally meanwhile.
        self._publishing = False
        # What the event loop synced while the lock was held (applied on the next take).
        self._synced: dict[str, tuple[int, int]] = {}
        self._io = threading.RLock()  # one round trip at a time, in order
        self.io = io
        self._charge = client.register_script(scripts.CHARGE)
        self._publish = client.register_script(scripts.PUBLISH)
        self._release = client.register_script(scripts.RELEASE)
        self._lean = client.register_script(scripts.LEAN)
        # Tenants the store's last answer said are under pressure (a sidecar was refused
        # for them within one TTL): their releases are written through.
        self._pressured: set[str] = set()
        self.reachable = False  # the last round trip succeeded (the sidecar's status)
        self.warming = False
        self.round_trips = 0
        self.take_backs = 0  # charges that asked the others to lean
        self.leans = 0  # requests to lean this sidecar answered

    @property
    def ttl_s(self) -> float:
        return self._ttl_ms / 1000

    def _argv(self) -> list[Any]:
        return [self._me, self._prefix, self._ttl_ms, self._ttl_ms]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The claims' lock, waited for (the store's threads; the sync API), with what
        the event loop synced meanwhile applied first."""
        with self._lock:
            self._apply_synced()
            yield

    def _try_lock(self) -> bool:
        """The claims' lock if free at once (the event loop never waits for it: a thread
        holding it may be waiting for the interpreter), with the syncs applied."""
        if not self._lock.acquire(blocking=False):
            return False
        self._apply_synced()
        return True

    def _apply_synced(self) -> None:
        while self._synced:
            tenant, (blocks, requests) = self._synced.popitem()
            claim = self._claims.setdefault(tenant, Claim())
            claim.blocks, claim.requests = blocks, requests

    def allows(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool:
        """Whether `charge` would admit these locally, within the allowance (False
        while a store thread holds the claims: ask the store)."""
        if not self._try_lock():
            return False
        try:
            claim = self._claims.get(tenant)
            return claim is not None and claim.allows(blocks, requests, limits)
        finally:
            self._lock.release()

    def take(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> bool:
        """Charge `blocks` and `requests` more within the allowance (`Outcome.LOCAL`, no
        round trip); False, and nothing charged, when they do not fit it, while a charge
        of the tenant is on its way to the store, or while a store thread holds the
        claims (the caller asks the store: never a wait on the event loop)."""
        if not self._try_lock():
            return False
        try:
            return self._take_locked(tenant, blocks, limits, requests)
        finally:
            self._lock.release()

    def _take_locked(self, tenant: str, blocks: int, limits: Limits, requests: int) -> bool:
        self._limits[tenant] = limits
        claim = self._claims.setdefault(tenant, Claim())
        if (self._publishing or self._charging.get(tenant)
                or not claim.allows(blocks, requests, limits)):
            return False
        claim.blocks, claim.requests = claim.blocks + blocks, claim.requests + requests
        return True

    def held(self, tenant: str) -> tuple[int, int]:
        """What this sidecar's admitted requests of `tenant` hold: blocks, requests."""
        synced = self._synced.get(tenant)
        if synced is not None:
            return synced
        claim = self._claims.get(tenant)
        return (claim.blocks, claim.requests) if claim else (0, 0)

    @property
    def ever_reached(self) -> bool:
        """Whether any round trip ever succeeded (before that nothing was claimed)."""
        return self.round_trips > 0

    def sync(self, tenant: str, blocks: int, requests: int) -> None:
        """Set what this sidecar's requests of `tenant` hold, as its own ledger counts
        them now (it moves as requests decode and finish); no round trip: the next
        charge or refresh writes it. Never waits: applied by whoever takes the lock next."""
        self._synced[tenant] = (max(0, blocks), max(0, requests))
        if self._try_lock():
            self._lock.release()

    def charge(self, tenant: str, blocks: int, limits: Limits, requests: int = 1, *,
               within_guarantee: bool = False) -> Outcome:
        """Admit `blocks` and `requests` more for `tenant` if the pool-wide ledger allows:
        locally within the allowance, else one check-and-charge on the store (a round
        trip: the sidecar calls this off its event loop, `PoolAdmission`).
        `within_guarantee`: only if what the tenant holds pool-wide, these blocks
        included, stays within its pool-wide guarantee (always a round trip: the
        allowance says nothing of what the others hold)."""
        with self._locked():
            if not within_guarantee and self._take_locked(tenant, blocks, limits, requests):
                return Outcome.LOCAL
            self._charging[tenant] = self._charging.get(tenant, 0) + 1
        try:
            return self._charge_now(tenant, blocks, requests, limits, within_guarantee)
        finally:
            with self._locked():
                self._charging[tenant] -= 1
                if not self._charging[tenant]:
                    del self._charging[tenant]

    def _charge_now(self, tenant: str, blocks: int, requests: int, limits: Limits,
                    within_guarantee: bool) -> Outcome:
        with self._io:
            with self._locked():
                self._limits[tenant] = limits
                claim = self._claims.setdefault(tenant, Claim())
                if not within_guarantee and claim.allows(blocks, requests, limits):
                    claim.blocks, claim.requests = claim.blocks + blocks, claim.requests + requests
                    return Outcome.LOCAL  # the allowance grew while it waited its turn
                nb, nr = claim.blocks + blocks, claim.requests + requests
            status = self._eval_charge(tenant, nb, nr, limits, within=within_guarantee)
            if status == -2:  # the store lost my hash (restarted): republish, then retry
                self._publish_now()
                status = self._eval_charge(tenant, nb, nr, limits, within=within_guarantee)
            if status == 2:
                self.take_backs += 1
                status, nb, nr = self._await_lean(tenant, blocks, requests, limits)
            if status == 1:
                with self._locked():  # what ended meanwhile stays ended
                    claim.blocks, claim.requests = claim.blocks + blocks, claim.requests + requests
                return Outcome.POOL
        if status == 0:
            return Outcome.REFUSED
        return Outcome.FALLBACK

    def _await_lean(self, tenant: str, blocks: int, requests: int,
                    limits: Limits) -> tuple[int, int, int]:
        """Retry a charge the others' allowances blocked while they lean, for at most
        `take_back_s` (the round-trip lock let go meanwhile: this sidecar's own listener
        may be asked to lean too); a sidecar that does not answer in time keeps its
        claim, and the charge is refused (0) rather than granted above maxBlocks. Returns
        the status and the new totals it was decided on."""
        deadline = time.monotonic() + self.take_back_s
        pause = 0.0005
        claim = self._claims[tenant]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return 0, 0, 0
            self._io.release()
            try:
                time.sleep(min(pause, left))
            finally:
                self._io.acquire()
            pause *= 2
            with self._locked():
                nb, nr = claim.blocks + blocks, claim.requests + requests
            status = self._eval_charge(tenant, nb, nr, limits, ask=False)
            if status != 2:
                return status, nb, nr
    def listen(self) -> None:
        """Answer the others' requests to lean (a thread on its own connection): when a
        charge elsewhere that what the tenant holds leaves room for finds this sidecar's
        unused allowance in the way, the allowance becomes what this sidecar holds, at once."""
        if self._listening is not None:
            return
        stop = self._listening = threading.Event()
        threading.Thread(target=self._listen, args=(stop,), daemon=True,
                         name=f"kvquota-pool-{self._me}").start()

    def close(self) -> None:
        """Stop answering requests to lean (the thread ends within a second)."""
        if self._listening is not None:
            self._listening.set()
            self._listening = None

    def _listen(self, stop: threading.Event) -> None:
        pause = 0.1
        while not stop.is_set():
            try:
                pubsub = self._client.pubsub()
                pubsub.subscribe(self._channel)
                pause = 0.1
                try:
                    while not stop.is_set():
                        message = pubsub.get_message(timeout=0.5)
                        if message is None:
                            continue
                        if message["type"] == "subscribe":
                            self.subscribed.set()
                        elif message["type"] == "message":
                            asker, _, tenant = bytes(message["data"]).decode().partition("\n")
                            if asker != self._me:
                                self.lean(tenant)
                finally:
                    self.subscribed.clear()
                    pubsub.close()
            except Exception:  # the store is down or restarting: subscribe again
                stop.wait(pause)
                # Back within a quarter of a TTL of the store's return: a take-back
                # needs every sidecar listening again before the grace is over.
                pause = min(2.0, self.ttl_s / 4, pause * 2)

    def lean(self, tenant: str) -> None:
        """This sidecar's allowance for `tenant` becomes what it holds, here (no local
        admission beyond it from now on) and then on the store."""
        try:
            # After any round trip of this sidecar's in flight: a refresh answered
            # meanwhile would otherwise grant back what is taken here.
            with self._io:
                with self._locked():
                    claim = self._claims.get(tenant)
                    if claim is None or tenant not in self._limits:
                        return
                    claim.allow_blocks = min(claim.allow_blocks, claim.blocks)
                    held = claim.blocks, claim.requests
                try:
                    pressured = int(self._lean(keys=self._keys, args=[
                        *self._argv(), tenant, *held]))
                except Exception:  # its claim still counts; the charge is refused meanwhile
                    self.reachable = False
                    return
                self.round_trips += 1
                self.reachable = True
                if pressured == -2:
                    self._publish_now()
                else:
                    self._note_pressure(tenant, pressured == 1)
        finally:
            self.leans += 1  # counted once answered: the store has what it wrote

    def release(self, tenant: str, blocks: int, requests: int = 1) -> bool:
        """`blocks` and `requests` of `tenant` ended (`released`, by difference; the
        sync API, as the tests' threads use it)."""
        with self._locked():
            claim = self._claims.setdefault(tenant, Claim())
            write = self._ended_locked(tenant, claim.blocks - blocks, claim.requests - requests)
        return write and self._write_held(tenant)

    def released(self, tenant: str, blocks: int, requests: int) -> bool:
        """A request of `tenant` ended: its requests hold `blocks` and `requests` now.
        Written through (one round trip, on `io`) when the claim was above the
        allowance (a store-granted charge the others' claims wait on) or the store last
        said the tenant is under pressure (a charge elsewhere is checked against what it
        holds); else the next refresh writes it. True: written (or, on `io`, sent).
        On `io` while a store thread holds the claims, it is written through anyway."""
        if self.io is None:
            with self._locked():
                write = self._ended_locked(tenant, blocks, requests)
            return write and self._write_held(tenant)
        if not self._try_lock():
            self._synced[tenant] = (max(0, blocks), max(0, requests))
            self.io.run(lambda: self._write_held(tenant))
            return True
        try:
            write = self._ended_locked(tenant, blocks, requests)
        finally:
            self._lock.release()
        if write:
            self.io.run(lambda: self._write_held(tenant))
        return write

    def _ended_locked(self, tenant: str, blocks: int, requests: int) -> bool:
        claim, limits = self._claims.get(tenant), self._limits.get(tenant)
        return claim is not None and limits is not None and claim.ended(
            blocks, requests, limits, tenant in self._pressured)

    def _write_held(self, tenant: str) -> bool:
        """Write what this sidecar's requests of `tenant` hold now (RELEASE)."""
        with self._io:
            with self._locked():
                claim = self._claims.setdefault(tenant, Claim())
                held = claim.blocks, claim.requests
            try:
                pressured = int(self._release(keys=self._keys, args=[
                    *self._argv(), tenant, *held]))
            except Exception:  # the next refresh writes it
                self.reachable = False
                return False
            self.round_trips += 1
            self.reachable = True
            self._note_pressure(tenant, pressured == 1)
            return pressured != -2

    def _note_pressure(self, tenant: str, pressured: bool) -> None:
        with self._locked():
            if pressured:
                self._pressured.add(tenant)
            else:
                self._pressured.discard(tenant)

    def refresh(self, limits: Mapping[str, Limits] | None = None) -> bool:
        """Republish every claim and keep this sidecar's key alive (call it at least
        three times per TTL). Allowances move toward charge + margin, capped at each
        tenant's per-engine ceiling and at what the other sidecars leave. False: the
        store did not answer (allowances unchanged). On `io`: sent, True."""
        if self.io is not None:
            self.io.run(lambda: self._refresh_now(limits))
            return True
        return self._refresh_now(limits)

    def _refresh_now(self, limits: Mapping[str, Limits] | None) -> bool:
        if limits:
            with self._locked():
                self._limits.update(limits)
        return self._publish_now()

    def _publish_now(self) -> bool:
        with self._io:
            try:
                return self._publish_io()
            finally:
                with self._locked():
                    self._publishing = False

    def _publish_io(self) -> bool:
        with self._locked():
            self._publishing = True
            order = list(self._limits)
            args: list[Any] = self._argv()
            for tenant in order:
                claim = self._claims.setdefault(tenant, Claim())
                lim = self._limits[tenant]
                cr = lim.ceiling_requests if lim.ceiling_requests is not None else 0
                cr = cr if lim.max_requests else 0
                args += [tenant, claim.blocks, claim.requests, claim.allow_blocks,
                         claim.allow_requests, lim.ceiling_blocks, cr, lim.max_blocks,
                         NO_LIMIT if lim.max_requests is None else lim.max_requests,
                         min(lim.ceiling_blocks, claim.blocks + lean_margin(
                             self._margin[0], lim.ceiling_blocks)),
                         min(cr, claim.requests + lean_margin(self._margin[1], cr))]
        try:
            granted = self._publish(keys=self._keys, args=args)
        except Exception:  # any store failure: keep what was claimed
            self.reachable = False
            return False
        self.round_trips += 1
        self.reachable = True
        self.warming = bool(granted[-1])
        with self._locked():
            for n, tenant in enumerate(order):
                claim = self._claims[tenant]
                claim.allow_blocks = int(granted[3 * n])
                claim.allow_requests = int(granted[3 * n + 1])
        for n, tenant in enumerate(order):
            self._note_pressure(tenant, int(granted[3 * n + 2]) == 1)
        return True

    def _eval_charge(self, tenant: str, nb: int, nr: int, limits: Limits,
                     ask: bool = True, within: bool = False) -> int:
        try:
            status, _b, _r, pressured = self._charge(keys=self._keys, args=[
                *self._argv(), tenant, nb, nr, limits.max_blocks,
                NO_LIMIT if limits.max_requests is None else limits.max_requests,
                NO_LIMIT if limits.guaranteed_blocks is None else limits.guaranteed_blocks,
                1 if ask else 0, 1 if within else 0])
        except Exception:  # down or slower than the timeout: fall back
            self.reachable = False
            return -1
        self.round_trips += 1
        self.reachable = True
        self.warming = status == -1
        if status != -2:
            self._note_pressure(tenant, int(pressured) == 1)
        return int(status)


def connect(address: str, password: str | None, timeout_s: float = 0.005) -> redis.Redis:
    """A client whose every call gives up after `timeout_s` (connect included): a slow
    store costs a request that much, then admission falls back."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    host, _, port = address.rpartition(":")
    return redis.Redis(host=host or address, port=int(port) if host else 6379,
                       password=password, socket_timeout=timeout_s,
                       socket_connect_timeout=timeout_s, retry_on_timeout=False,
                       retry=Retry(NoBackoff(), 0))
