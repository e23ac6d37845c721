-- Argo CD health of KVQuota's kinds (kvquota.dev), from status.conditions. argocd-cm
-- names this one script for both kinds; each key runs it alone, with `obj` set.
--
-- InferencePool:
--   Healthy      Ready=True and Synced=True
--   Degraded     Oversubscribed=True (the accepted guarantees do not fit the capacity),
--                or Ready=False with a reason that needs a person (a bad spec, a missing
--                Gateway API pool, ...)
--   Progressing  Synced not yet True, and Ready=False for a reason in TRANSIENT below.
-- The operator (kvquota/status.py) reports Ready=False with reason NoEngines while the
-- selector matches no pod and EnginesNotReady while none of them is ready: engines take
-- minutes to be scheduled, pull an image and load a model, and the pool is not broken
-- meanwhile. Every other Ready=False reason (InvalidSpec, GatewayPoolNotFound,
-- GatewayPoolInvalid, and any added later) needs a person: Degraded.
--
-- TenantQuota:
--   Healthy      Ready=True and Accepted=True
--   Degraded     Accepted=False (does not fit the pool, invalid), Degraded=True (lease
--                breaks, premium preemptions or degraded-mode releases in the last
--                window), or Ready=False because of its pool: PoolNotFound (spec.poolRef
--                names no InferencePool) or PoolInvalid (the pool's spec is invalid)
--
-- Both: Progressing for anything else: no status yet, status older than the spec
-- (observedGeneration < metadata.generation), Unknown conditions.
local TRANSIENT = {
  NoEngines = true,
  EnginesNotReady = true,
}
local POOL_BROKEN = {
  PoolNotFound = true,
  PoolInvalid = true,
}

local function find(conditions, type)
  for _, c in ipairs(conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end

local function is(c, status)
  return c ~= nil and c.status == status
end

local function describe(c)
  local text = c.type .. "=" .. c.status
  if c.reason ~= nil and c.reason ~= "" then
    text = text .. " (" .. c.reason .. ")"
  end
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

local function stale(generation, status, conditions)
  if generation == nil then
    return false
  end
  if status.observedGeneration ~= nil and status.observedGeneration < generation then
    return true
  end
  for _, c in ipairs(conditions) do
    if c.observedGeneration ~= nil and c.observedGeneration < generation then
      return true
    end
  end
  return false
end

local function degrade(hs, c)
  hs.status = "Degraded"
  hs.message = describe(c)
end

-- Not Degraded: Healthy once Ready and `also` are True, else Progressing with the
-- condition that holds it back.
local function settle(hs, ready, also)
  if is(ready, "True") and is(also, "True") then
    hs.status = "Healthy"
    hs.message = describe(ready)
  elseif ready ~= nil and ready.status ~= "True" then
    hs.message = describe(ready)
  elseif also ~= nil then
    hs.message = describe(also)
  end
end

local hs = { status = "Progressing", message = "Waiting for the KVQuota operator" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local conditions = obj.status.conditions
if stale(obj.metadata.generation, obj.status, conditions) then
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end

local ready = find(conditions, "Ready")
if obj.kind == "TenantQuota" then
  local accepted = find(conditions, "Accepted")
  local degraded = find(conditions, "Degraded")
  if is(accepted, "False") then
    degrade(hs, accepted)
  elseif is(degraded, "True") then
    degrade(hs, degraded)
  elseif is(ready, "False") and POOL_BROKEN[ready.reason or ""] then
    degrade(hs, ready)
  else
    settle(hs, ready, accepted)
  end
  return hs
end

local synced = find(conditions, "Synced")
local oversubscribed = find(conditions, "Oversubscribed")
if is(oversubscribed, "True") then
  degrade(hs, oversubscribed)
elseif is(ready, "False") and not TRANSIENT[ready.reason or ""] then
  degrade(hs, ready)
else
  settle(hs, ready, synced)
end
return hs
