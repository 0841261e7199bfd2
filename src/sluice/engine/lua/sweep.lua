-- sweep: settle callers' held reservations that nobody will settle.
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[8] held (callers' held reservations -> when their hold ends)
-- KEYS[9] wake (idle workers are woken when tokens go back to a budget with parked jobs)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] how: 'unknown' | 'refund'
-- ARGV[3 ...] reservation ids (stored form, 'u:<id>'); none: the holds whose time
--   ran out, at most SWEEP_MAX, settled as unknown outcomes (ARGV[2] must be 'unknown')
--
-- Returns a flat list of (id, state after the call, 1 if this call settled it,
-- tokens it charges now):
-- a named id that is not held any more is left as it is ('missing' if it is gone).

-- @include clock
-- @include ledger

local SWEEP_MAX = 100

local K = with_flow_keys({held = KEYS[8]}, 1)
local now, how = clock_ms(ARGV[1]), ARGV[2]
local out = {}
if #ARGV < 3 then
  local due, states, changed = sweep_expired(K, now, SWEEP_MAX)
  for i = 1, #due do
    out[#out + 1] = due[i]
    out[#out + 1] = states[i]
    if changed[i] then out[#out + 1] = 1 else out[#out + 1] = 0 end
    out[#out + 1] = tonumber(redis.call('HGET', K.resvp .. due[i], 'amt')) or 0
  end
  return out
end
local woke = false
for i = 3, math.min(#ARGV, 2 + SWEEP_MAX) do
  local state, changed, freed = settle(K, ARGV[i], how, -1, now)
  redis.call('ZREM', K.held, ARGV[i])
  if freed and not woke then
    redis.call('ZADD', KEYS[9], 0, 'w')
    woke = true
  end
  out[#out + 1] = ARGV[i]
  out[#out + 1] = state
  if changed then out[#out + 1] = 1 else out[#out + 1] = 0 end
  out[#out + 1] = tonumber(redis.call('HGET', K.resvp .. ARGV[i], 'amt')) or 0
end
return out
