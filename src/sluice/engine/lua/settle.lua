-- settle: commit the actual usage of a held reservation, or refund it.
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[8] wake (idle workers are woken when tokens go back to a budget with parked jobs)
-- KEYS[9] events (an 'overspent' event per budget the commit takes past its limit)
-- KEYS[10] held (callers' held reservations: a settled one leaves it)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] reservation id  ARGV[3] 'commit' | 'refund' | 'unknown'
-- ARGV[4] tokens actually used (commit; -1 keeps the reserved amount)  ARGV[5] events stream max length
--
-- Returns {state, changed, charged, beyond}: the reservation's state after the
-- call ('missing' if there is none), 1 if this call settled it (0: it was
-- settled before, so repeating a commit or refund changes nothing), the tokens
-- it charges now, and how many of them go beyond the estimate.

-- @include clock
-- @include ledger

local K = with_flow_keys({events = KEYS[9], maxlen = ARGV[5]}, 1)
local state, changed, freed, crossed = settle(K, ARGV[2], ARGV[3], tonumber(ARGV[4]), clock_ms(ARGV[1]))
if freed then redis.call('ZADD', KEYS[8], 0, 'w') end
redis.call('ZREM', KEYS[10], ARGV[2])
-- (a caller's reservation is stored as 'u:<its id>': the event names the id it chose)
emit_overspent(K, crossed, '', (string.gsub(ARGV[2], '^u:', '', 1)))
local r = redis.call('HMGET', K.resvp .. ARGV[2], 'amt', 'beyond')
local flag = 0
if changed then flag = 1 end
return {state, flag, tonumber(r[1]) or 0, tonumber(r[2]) or 0}
