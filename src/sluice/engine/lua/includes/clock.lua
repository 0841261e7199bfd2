-- clock_ms(arg) -> now (ms)
-- Every time a script judges (leases, windows, delays, throttles, calendar
-- periods) is Redis's own, so hosts whose clocks disagree still agree on
-- when a lease ends or a window turns. A caller passes '' for that; tests
-- that drive time pass a number instead (the engine's callers never do).
-- TIME is allowed before writes because scripts replicate their effects
-- (the default from Redis 5, the only mode from 7).
local function clock_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
