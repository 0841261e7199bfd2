-- retention: the queue's retention as it applies now, defaults filled in.
--
-- KEYS[1] retention
-- Returns {kind, age (ms, 0 = no limit), count (0 = no limit), ...} for every kind.

-- @include retention

local ret = retention({retention = KEYS[1]})
local out = {}
for _, kind in ipairs(RETENTION_KINDS) do
  out[#out + 1] = kind
  out[#out + 1] = ret[kind].age
  out[#out + 1] = ret[kind].count
end
return out
