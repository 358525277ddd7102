-- Argo CD health for kvpersist.dev/KVCacheNamespace, from the status the operator writes.
-- Configure as resource.customizations.health.kvpersist.dev_KVCacheNamespace (docs/gitops.md).
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function message(kind, fallback)
  local c = condition(kind)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpersist operator to observe the resource"
  return hs
end

if obj.metadata ~= nil and obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end

local phase = obj.status.phase
if phase == "Ready" then
  hs.status = "Healthy"
  hs.message = message("Ready", "Cache and vLLM are serving")
elseif phase == "Degraded" or phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message("Ready", phase)
elseif phase == "CacheDisabled" then
  -- vLLM serves, but without the cache the resource asks for: an identity pin is missing.
  hs.status = "Degraded"
  hs.message = message("IdentityResolved", "Cache disabled: identity pins incomplete")
else
  hs.status = "Progressing"
  hs.message = message("Ready", phase)
end
return hs
