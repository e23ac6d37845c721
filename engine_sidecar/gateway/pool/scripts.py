"""The pool-wide ledger's Lua scripts, each one atomic step on the store (EVALSHA):
check-and-charge, republish (allowances granted within what the others leave), a
release, and a lean (an allowance taken back). Their keys share the pool's hash tag;
the protocol: docs/gateway.md (pool).
"""

# KEYS: live zset, my hash, epoch. ARGV: me, key prefix, ttl ms, grace ms, tenant,
# new b, new r, max b (-1: none), max r (-1: none), guaranteed b (-1: none), ask (1: may
# ask the others to lean), within (1: grant only if what the tenant holds pool-wide,
# this charge included, stays within its guarantee; a no marks the tenant, so what
# every sidecar holds of it is written through for one TTL and the next check is fresh).
# Returns {status, others' b claims, others' r claims,
# pressured}: 1 granted, 0 refused, 2 what is held leaves room but the others'
# allowances fill maxBlocks (they were asked to lean: retry), -1 warming (grace after an empty
# store), -2 my hash is gone (republish first); pressured: 1 while a sidecar of the pool
# was refused for the tenant within one TTL.
PRELUDE = """
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

CHARGE = PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return {-2, 0, 0, 0} end
local tenant = ARGV[5]
local b, r, held = others(tenant)
if warming then return {-1, b, r, redis.call('EXISTS', pressure .. tenant)} end
local nb, nr = tonumber(ARGV[6]), tonumber(ARGV[7])
local mb, mr, gb = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
if ARGV[12] == '1' and (gb < 0 or held + nb > gb) then
  redis.call('SET', pressure .. tenant, 1, 'PX', tonumber(ARGV[3]))
  return {0, b, r, 1}
end
local fits = mb < 0 or b + nb <= mb
-- A tenant with a pool-wide guarantee is checked against what it holds, not against
-- the room the others may still admit into locally (their allowances, what they held
-- when they last published): when the holdings leave room, those allowances are taken
-- back first, by the others themselves (they may have used them since), and the charge
-- is retried on the claims.
local takeable = gb >= 0 and mb >= 0 and held + nb <= mb
if (not fits and not takeable) or (mr >= 0 and r + nr > mr) then
  redis.call('SET', pressure .. tenant, 1, 'PX', tonumber(ARGV[3]))
  return {0, b, r, 1}
end
if not fits then
  redis.call('SET', pressure .. tenant, 1, 'PX', tonumber(ARGV[3]))
  if ARGV[11] == '1' then
    redis.call('PUBLISH', string.sub(ARGV[2], 1, -3) .. 'lean', ARGV[1] .. '\\n' .. tenant)
  end
  return {2, b, r, 1}
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
PUBLISH = PRELUDE + """
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
RELEASE = PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
redis.call('HSET', KEYS[2], 'b:' .. ARGV[5], tonumber(ARGV[6]), 'r:' .. ARGV[5],
           tonumber(ARGV[7]))
keep_alive()
return redis.call('EXISTS', pressure .. ARGV[5])
"""

# ARGV: me, prefix, ttl ms, grace ms, tenant, b, r. Asked to lean: this sidecar's
# allowance for the tenant becomes what it holds (never a growth). Returns as RELEASE.
LEAN = PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
local b = tonumber(ARGV[6])
local ab = tonumber(redis.call('HGET', KEYS[2], 'ab:' .. ARGV[5]) or 0)
redis.call('HSET', KEYS[2], 'b:' .. ARGV[5], b, 'r:' .. ARGV[5], tonumber(ARGV[7]),
           'ab:' .. ARGV[5], math.min(ab, b))
keep_alive()
return redis.call('EXISTS', pressure .. ARGV[5])
"""
