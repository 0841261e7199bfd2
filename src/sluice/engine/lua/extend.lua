-- extend: renew the leases of running jobs, fenced by their attempt tokens.
--
-- KEYS[1] active   KEYS[1 + i] job key of the i-th job
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] lease (ms)  ARGV[3 + 2 * (i - 1) ...] id, token
--
-- Returns one code per job: 1 extended, 2 extended but a cancel was requested
-- (the worker should stop the handler), 0 lease lost (the job was reaped or
-- finished elsewhere: the worker must stop and not report), -1 no such job.

-- @include clock

local deadline = clock_ms(ARGV[1]) + tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS - 1 do
  local id, token = ARGV[3 + 2 * (i - 1)], ARGV[4 + 2 * (i - 1)]
  local cur = redis.call('HMGET', KEYS[1 + i], 'state', 'token', 'cancel')
  if not cur[1] then
    out[i] = -1
  elseif cur[1] ~= 'active' or cur[2] ~= token then
    out[i] = 0
  else
    redis.call('ZADD', KEYS[1], 'XX', deadline, id)
    if cur[3] then out[i] = 2 else out[i] = 1 end
  end
end
return out
