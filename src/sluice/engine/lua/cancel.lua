-- cancel: cancel one job that has not finished.
--
-- KEYS[1] job key   KEYS[2] waiting   KEYS[3] delayed   KEYS[4] events   KEYS[5] stats
-- KEYS[6] prefix of the parked-jobs sets of budgets (parked:<budget>)
-- KEYS[7] retention   KEYS[8] prefix of the finished:<kind> sets (see includes/retention.lua)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] job id  ARGV[3] events stream max length
-- ARGV[4] '1': cancel ahead: a job not added yet is cancelled before it is (a caller's id only)
--
-- Returns {code, state}: 1 cancelled (it was waiting, delayed or parked; or, ahead, not
-- there yet: state ''); 2 a cancel was requested from the running worker, which stops the
-- handler at its next lease renewal; 0 nothing done (state is terminal); -1 no such job.
--
-- Cancelled ahead, a job is a cancelled record with no payload, kept as any finished job
-- is: adding its id finds it and adds nothing (add.lua), so a cancel that overtakes the add
-- it answers (the service stores a job before it enqueues it) still wins.

-- @include clock
-- @include emit
-- @include retention

local now = clock_ms(ARGV[1])
local state = redis.call('HGET', KEYS[1], 'state')
if not state and ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'v', 1, 'name', '', 'priority', 0, 'state', 'cancelled', 'attempt', 0,
    'token', 0, 'failures', 0, 'stalls', 0, 'max_attempts', 1, 'timeout_ms', 0, 'max_stalls', 0,
    'created', now, 'finished', now, 'tokens', 0)
  retain({retention = KEYS[7], finp = KEYS[8]}, 'cancelled', KEYS[1], ARGV[2], now)
  redis.call('HINCRBY', KEYS[5], 'cancelled', 1)
  emit(KEYS[4], ARGV[3], 'cancelled', ARGV[2])
  return {1, ''}
end
if not state then return {-1, ''} end
if state == 'waiting' or state == 'delayed' or state == 'parked' then
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  local budget = redis.call('HGET', KEYS[1], 'parked')
  if budget then
    redis.call('ZREM', KEYS[6] .. budget, ARGV[2])
    redis.call('HDEL', KEYS[1], 'parked')
  end
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished', now)
  retain({retention = KEYS[7], finp = KEYS[8]}, 'cancelled', KEYS[1], ARGV[2], now)
  redis.call('HINCRBY', KEYS[5], 'cancelled', 1)
  emit(KEYS[4], ARGV[3], 'cancelled', ARGV[2])
  return {1, state}
elseif state == 'active' then
  redis.call('HSET', KEYS[1], 'cancel', now)
  emit(KEYS[4], ARGV[3], 'cancel_requested', ARGV[2])
  return {2, state}
end
return {0, state}
