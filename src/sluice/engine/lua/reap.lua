-- reap: return jobs whose lease expired (their worker died or hung) to waiting,
-- counting a stall; a job that stalled more than its max_stalls is dead-lettered.
--
-- KEYS[1] active   KEYS[2] waiting   KEYS[3] dead   KEYS[4] events
-- KEYS[5] stats    KEYS[6] wake      KEYS[7] job key prefix
-- KEYS[8 .. 14]    flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[15] retention   KEYS[16] prefix of the finished:<kind> sets (see includes/retention.lua)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] most jobs to reap in this call
-- ARGV[3] events stream max length
--
-- A job whose cancellation was requested is cancelled instead of returned.
-- The attempt's token reservation stays charged, as an "unknown outcome": the
-- handler may have called the provider before its worker was lost.
-- Returns {returned to waiting, dead-lettered}. The stale worker's late answer
-- is refused afterwards because the token no longer matches an active lease.

-- @include clock
-- @include emit
-- @include wake
-- @include ledger
-- @include retention

local K = with_flow_keys({dead = KEYS[3], retention = KEYS[15], finp = KEYS[16]}, 8)

local now = clock_ms(ARGV[1])
local maxlen = ARGV[3]
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local back, dead, cancelled, unknown = 0, 0, 0, 0
for i = 1, #expired do
  local id = expired[i]
  local jk = KEYS[7] .. id
  redis.call('ZREM', KEYS[1], id)
  local f = redis.call('HMGET', jk, 'score', 'max_stalls', 'worker', 'stalls', 'cancel', 'rid', 'token')
  -- ('rid' names the last attempt that reserved: not this one, if this one did not)
  if f[6] and f[6] == id .. ':' .. (f[7] or '') then
    local _, changed = settle(K, f[6], 'unknown', -1, now, reservation_keep_ms(K))
    if changed then unknown = unknown + 1 end
    record_spend(K, jk, f[6], 'lease lost', -1)
  end
  if f[1] then
    local stalls = (tonumber(f[4]) or 0) + 1
    redis.call('HSET', jk, 'stalls', stalls)
    emit(KEYS[4], maxlen, 'stalled', id, 'worker', f[3] or '')
    if f[5] then
      -- Its cancellation was requested: end it here rather than run it again.
      redis.call('HSET', jk, 'state', 'cancelled', 'finished', now)
      retain(K, 'cancelled', jk, id, now)
      redis.call('HINCRBY', KEYS[5], 'cancelled', 1)
      emit(KEYS[4], maxlen, 'cancelled', id)
      cancelled = cancelled + 1
    elseif stalls > (tonumber(f[2]) or 0) then
      local err = 'lease expired ' .. stalls .. ' times (worker lost or hung); last worker '
        .. (f[3] or '?')
      redis.call('HSET', jk, 'state', 'dead', 'finished', now, 'error', err)
      retain(K, 'dead', jk, id, now)
      emit(KEYS[4], maxlen, 'dead', id, 'error', err)
      dead = dead + 1
    else
      redis.call('HSET', jk, 'state', 'waiting')
      redis.call('ZADD', KEYS[2], f[1], id)
      back = back + 1
    end
  end
end
if back + dead + cancelled > 0 then
  redis.call('HINCRBY', KEYS[5], 'stalled', back + dead + cancelled)
  if dead > 0 then redis.call('HINCRBY', KEYS[5], 'dead', dead) end
  wake_if_waiting(KEYS[2], KEYS[6])
end
if unknown > 0 then redis.call('HINCRBY', KEYS[5], 'unknown_outcome', unknown) end
return {back, dead}
