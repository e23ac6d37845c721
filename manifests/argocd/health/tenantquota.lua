-- Argo CD health of a TenantQuota (tenantquotas.kvquota.dev), from status.conditions.
--   Healthy      Ready=True and Accepted=True
--   Degraded     Accepted=False (does not fit the pool, invalid), Degraded=True (lease
--                breaks, premium preemptions or degraded-mode releases in the last
--                window), or Ready=False because of its pool: PoolNotFound (spec.poolRef
--                names no InferencePool) or PoolInvalid (the pool's spec is invalid)
--   Progressing  anything else: no status yet, status older than the spec
--                (observedGeneration < metadata.generation), Unknown conditions
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

local hs = { status = "Progressing", message = "Waiting for the KVQuota operator" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local conditions = obj.status.conditions
if stale(obj.metadata.generation, obj.status, conditions) then
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end

local accepted = find(conditions, "Accepted")
local ready = find(conditions, "Ready")
local degraded = find(conditions, "Degraded")
if is(accepted, "False") then
  hs.status = "Degraded"
  hs.message = describe(accepted)
elseif is(degraded, "True") then
  hs.status = "Degraded"
  hs.message = describe(degraded)
elseif is(ready, "False") and POOL_BROKEN[ready.reason or ""] then
  hs.status = "Degraded"
  hs.message = describe(ready)
elseif is(ready, "True") and is(accepted, "True") then
  hs.status = "Healthy"
  hs.message = describe(ready)
elseif ready ~= nil and ready.status ~= "True" then
  hs.message = describe(ready)
elseif accepted ~= nil then
  hs.message = describe(accepted)
end
return hs
