-- redrive: move dead-lettered jobs back to waiting with fresh attempts.
--
-- KEYS[1] dead   KEYS[2] waiting   KEYS[3] events   KEYS[4] wake
-- KEYS[4 + i]    job key of the i-th job
-- ARGV[1] events stream max length  ARGV[1 + i] id of the i-th job
--
-- Returns one code per job: 1 redriven, 0 not dead (left alone), -1 no such job.

-- @include emit
-- @include wake

local out = {}
for i = 1, #KEYS - 4 do
  local jk, id = KEYS[4 + i], ARGV[1 + i]
  local cur = redis.call('HMGET', jk, 'state', 'score')
  if not cur[1] then
    out[i] = -1
  elseif cur[1] ~= 'dead' then
    out[i] = 0
  else
    redis.call('ZREM', KEYS[1], id)
    redis.call('HSET', jk, 'state', 'waiting', 'attempt', 0, 'failures', 0, 'stalls', 0)
    redis.call('HDEL', jk, 'finished', 'cancel')
    redis.call('PERSIST', jk)  -- a dead record expires (retention); a live one must not
    redis.call('ZADD', KEYS[2], cur[2], id)
    emit(KEYS[3], ARGV[1], 'redriven', id)
    out[i] = 1
  end
end
wake_if_waiting(KEYS[2], KEYS[4])
return out
