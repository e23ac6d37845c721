"""The pool-wide ledger on a shared store (Redis or Valkey): what every engine's sidecar
has claimed of each tenant's pool-wide maxBlocks and maxConcurrentRequests.

Each sidecar writes only its own hash, under a TTL it refreshes, so a dead sidecar's
charges expire; the pool total is the sum over live sidecars. A claim is the more of
what a sidecar's requests hold (`b`, `r`) and its allowance (`ab`, `ar`): what it may
admit with no round trip. Every change that raises a claim is one Lua script (EVALSHA)
that writes only if the pool-wide limit allows, so two sidecars never both take the
last blocks. A refusal marks the tenant for one TTL, and every sidecar's refresh then
lowers its allowance to what it holds plus a margin. After a store restart (a new epoch)
nothing grows for one TTL while sidecars republish. Keys share one hash tag (`{pool}`),
so a cluster keeps them on one slot. The protocol in full: docs/gateway.md (pool).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

# KEYS: live zset, my hash, epoch. ARGV: me, key prefix, ttl ms, grace ms, tenant,
# new b, new r, max b (-1: none), max r (-1: none), guaranteed b (-1: none).
# Returns {status, others' b claims, others' r claims, pressured}: 1 granted, 0 refused,
# -1 warming (grace after an empty store), -2 my hash is gone (republish first);
# pressured: 1 while a sidecar of the pool was refused for the tenant within one TTL.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  redis.call('SET', KEYS[3], now)
  epoch = now
end
local warming = (now - tonumber(epoch)) < tonumber(ARGV[4])
local pressure = string.sub(ARGV[2], 1, -3) .. 'p:'
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
local function others(tenant)
  local b, r, held = 0, 0, 0
  for _, s in ipairs(live) do
    if s ~= ARGV[1] then
      local v = redis.call('HMGET', ARGV[2] .. s, 'b:' .. tenant, 'r:' .. tenant,
                           'ab:' .. tenant, 'ar:' .. tenant)
      b = b + math.max(tonumber(v[1]) or 0, tonumber(v[3]) or 0)
      r = r + math.max(tonumber(v[2]) or 0, tonumber(v[4]) or 0)
      held = held + (tonumber(v[1]) or 0)
    end
  end
  return b, r, held
end
local function keep_alive()
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
end
"""

_CHARGE = _PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return {-2, 0, 0, 0} end
local tenant = ARGV[5]
local b, r, held = others(tenant)
if warming then return {-1, b, r, redis.call('EXISTS', pressure .. tenant)} end
local nb, nr = tonumber(ARGV[6]), tonumber(ARGV[7])
local mb, mr, gb = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local fits = mb < 0 or b + nb <= mb
-- Within its pool-wide guarantee a tenant is checked against what it holds, not
-- against the room the others may still admit into locally (their allowances).
local guaranteed = gb >= 0 and held + nb <= gb and (mb < 0 or held + nb <= mb)
if (not fits and not guaranteed) or (mr >= 0 and r + nr > mr) then
  redis.call('SET', pressure .. tenant, 1, 'PX', tonumber(ARGV[3]))
  return {0, b, r, 1}
end
if not fits then  -- granted on the guarantee: the others' allowances lean at refresh
  redis.call('SET', pressure .. tenant, 1, 'PX', tonumber(ARGV[3]))
end
redis.call('HSET', KEYS[2], 'b:' .. tenant, nb, 'r:' .. tenant, nr)
keep_alive()
return {1, b, r, redis.call('EXISTS', pressure .. tenant)}
"""

# ARGV from 5 on, per tenant (11 each): tenant, b, r, held ab, held ar, wanted ab,
# wanted ar (its per-engine ceiling), max b, max r, then the lean allowances wanted
# while a sidecar of the pool was refused for the tenant within the last TTL (what it
# holds plus a margin): an allowance shrinks only when another engine needs the room.
# An allowance that grows is granted only outside the grace and within what the others
# leave.
# Returns per tenant in order the granted allowances, ab then ar, and whether the tenant
# is under pressure (1: marked); then the warming flag.
_PUBLISH = _PRELUDE + """
local fields = {'_', 1}
local granted = {}
local i = 5
while i + 10 <= #ARGV do
  local tenant = ARGV[i]
  local b, r = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local hab, har = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local wab, war = tonumber(ARGV[i + 5]), tonumber(ARGV[i + 6])
  local mb, mr = tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8])
  local pressured = redis.call('EXISTS', pressure .. tenant)
  if pressured == 1 then
    wab, war = tonumber(ARGV[i + 9]), tonumber(ARGV[i + 10])
  end
  local ob, orq = others(tenant)
  local ab, ar = math.min(hab, wab), math.min(har, war)
  if not warming then
    if wab > ab then
      local room = wab
      if mb >= 0 then room = math.min(wab, mb - ob) end
      ab = math.max(ab, room)
    end
    if war > ar then
      local room = war
      if mr >= 0 then room = math.min(war, mr - orq) end
      ar = math.max(ar, room)
    end
  end
  table.insert(fields, 'b:' .. tenant); table.insert(fields, b)
  table.insert(fields, 'r:' .. tenant); table.insert(fields, r)
  table.insert(fields, 'ab:' .. tenant); table.insert(fields, ab)
  table.insert(fields, 'ar:' .. tenant); table.insert(fields, ar)
  table.insert(granted, ab); table.insert(granted, ar); table.insert(granted, pressured)
  i = i + 11
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
keep_alive()
if warming then table.insert(granted, 1) else table.insert(granted, 0) end
return granted
"""

# ARGV: me, prefix, ttl ms, grace ms, tenant, b, r. A release: never checked.
# Returns whether the tenant is under pressure (-2: my hash is gone, the refresh
# republishes it).
_RELEASE = _PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
redis.call('HSET', KEYS[2], 'b:' .. ARGV[5], tonumber(ARGV[6]), 'r:' .. ARGV[5],
           tonumber(ARGV[7]))
keep_alive()
return redis.call('EXISTS', pressure .. ARGV[5])
"""

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
    # Pool-wide guaranteed blocks: a charge that keeps what the tenant holds within
    # them is granted whatever the others' allowances claim (None: no such rule).
    guaranteed_blocks: int | None = None


@dataclass
class _Claim:
    blocks: int = 0
    requests: int = 0
    allow_blocks: int = 0
    allow_requests: int = 0


class PoolStore:
    """One sidecar's side of the pool-wide ledger. Thread-safe (one lock): the
    sidecar calls it from its event loop, tests from several threads."""

    def __init__(self, client: redis.Redis, pool: str, sidecar: str, *,
                 ttl_s: float = 10.0, margin_blocks: int = 16, margin_requests: int = 1,
                 ) -> None:
        self._client = client
        self._prefix = f"kvq:{{{pool}}}:c:"
        self._keys = [f"kvq:{{{pool}}}:live", self._prefix + sidecar, f"kvq:{{{pool}}}:epoch"]
        self._me = sidecar
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._margin = (margin_blocks, margin_requests)
        self._claims: dict[str, _Claim] = {}
        self._limits: dict[str, Limits] = {}
        self._lock = threading.Lock()
        self._charge = client.register_script(_CHARGE)
        self._publish = client.register_script(_PUBLISH)
        self._release = client.register_script(_RELEASE)
        # Tenants the store's last answer said are under pressure (a sidecar was refused
        # for them within one TTL): their releases are written through.
        self._pressured: set[str] = set()
        self.reachable = False  # the last round trip succeeded (the sidecar's status)
        self.warming = False
        self.round_trips = 0

    @property
    def ttl_s(self) -> float:
        return self._ttl_ms / 1000

    def _argv(self) -> list[Any]:
        return [self._me, self._prefix, self._ttl_ms, self._ttl_ms]

    def held(self, tenant: str) -> tuple[int, int]:
        """What this sidecar's admitted requests of `tenant` hold: blocks, requests."""
        claim = self._claims.get(tenant)
        return (claim.blocks, claim.requests) if claim else (0, 0)

    @property
    def ever_reached(self) -> bool:
        """Whether any round trip ever succeeded (before that nothing was claimed)."""
        return self.round_trips > 0

    def sync(self, tenant: str, blocks: int, requests: int) -> None:
        """Set what this sidecar's requests of `tenant` hold, as its own ledger counts
        them now (it moves as requests decode and finish); no round trip: the next
        charge or refresh writes it."""
        with self._lock:
            claim = self._claims.setdefault(tenant, _Claim())
            claim.blocks, claim.requests = max(0, blocks), max(0, requests)

    def charge(self, tenant: str, blocks: int, limits: Limits, requests: int = 1) -> Outcome:
        """Admit `blocks` and `requests` more for `tenant` if the pool-wide ledger allows:
        locally within the allowance, else one check-and-charge on the store."""
        with self._lock:
            self._limits[tenant] = limits
            claim = self._claims.setdefault(tenant, _Claim())
            nb, nr = claim.blocks + blocks, claim.requests + requests
            if nb <= claim.allow_blocks and (
                    limits.max_requests is None or nr <= claim.allow_requests):
                claim.blocks, claim.requests = nb, nr
                return Outcome.LOCAL
            status = self._eval_charge(tenant, nb, nr, limits)
            if status == -2:  # the store lost my hash (restarted): republish, then retry
                self._publish_locked()
                status = self._eval_charge(tenant, nb, nr, limits)
            if status == 1:
                claim.blocks, claim.requests = nb, nr
                return Outcome.POOL
            if status == 0:
                return Outcome.REFUSED
            return Outcome.FALLBACK

    def release(self, tenant: str, blocks: int, requests: int = 1) -> bool:
        """`blocks` and `requests` of `tenant` ended (`released`, by difference)."""
        with self._lock:
            claim = self._claims.setdefault(tenant, _Claim())
            return self._released_locked(tenant, claim.blocks - blocks,
                                         claim.requests - requests)

    def released(self, tenant: str, blocks: int, requests: int) -> bool:
        """A request of `tenant` ended: its requests hold `blocks` and `requests` now.
        Written through (one round trip) when the claim was above the allowance (a
        store-granted charge the others' claims wait on) or the store last said the
        tenant is under pressure (a charge within its guarantee elsewhere is checked
        against what it holds); else the next refresh writes it. True: written."""
        with self._lock:
            return self._released_locked(tenant, blocks, requests)

    def _released_locked(self, tenant: str, blocks: int, requests: int) -> bool:
        claim, limits = self._claims.get(tenant), self._limits.get(tenant)
        if claim is None or limits is None:
            return False
        above = claim.blocks > claim.allow_blocks or (
            limits.max_requests is not None and claim.requests > claim.allow_requests)
        claim.blocks, claim.requests = max(0, blocks), max(0, requests)
        if not (above or tenant in self._pressured):
            return False
        try:
            pressured = self._release(keys=self._keys, args=[
                *self._argv(), tenant, claim.blocks, claim.requests])
        except Exception:  # the next refresh writes it
            self.reachable = False
            return False
        self.round_trips += 1
        self.reachable = True
        self._note_pressure(tenant, int(pressured) == 1)
        return int(pressured) != -2

    def _note_pressure(self, tenant: str, pressured: bool) -> None:
        if pressured:
            self._pressured.add(tenant)
        else:
            self._pressured.discard(tenant)

    def refresh(self, limits: Mapping[str, Limits] | None = None) -> bool:
        """Republish every claim and keep this sidecar's key alive (call it at least
        three times per TTL). Allowances move toward charge + margin, capped at each
        tenant's per-engine ceiling and at what the other sidecars leave. False: the
        store did not answer (allowances unchanged)."""
        with self._lock:
            if limits:
                self._limits.update(limits)
            return self._publish_locked()

    def _publish_locked(self) -> bool:
        order = list(self._limits)
        args: list[Any] = self._argv()
        for tenant in order:
            claim = self._claims.setdefault(tenant, _Claim())
            lim = self._limits[tenant]
            cr = lim.ceiling_requests if lim.ceiling_requests is not None else 0
            cr = cr if lim.max_requests else 0
            args += [tenant, claim.blocks, claim.requests, claim.allow_blocks,
                     claim.allow_requests, lim.ceiling_blocks, cr,
                     lim.max_blocks, NO_LIMIT if lim.max_requests is None else lim.max_requests,
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
        for n, tenant in enumerate(order):
            claim = self._claims[tenant]
            claim.allow_blocks, claim.allow_requests = int(granted[3 * n]), int(granted[3 * n + 1])
            self._note_pressure(tenant, int(granted[3 * n + 2]) == 1)
        return True

    def _eval_charge(self, tenant: str, nb: int, nr: int, limits: Limits) -> int:
        try:
            status, _b, _r, pressured = self._charge(keys=self._keys, args=[
                *self._argv(), tenant, nb, nr, limits.max_blocks,
                NO_LIMIT if limits.max_requests is None else limits.max_requests,
                NO_LIMIT if limits.guaranteed_blocks is None else limits.guaranteed_blocks])
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
