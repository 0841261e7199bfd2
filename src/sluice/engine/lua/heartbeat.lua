-- heartbeat: a worker says it is alive; workers silent too long are forgotten.
--
-- KEYS[1] workers (hash: worker id -> JSON description)
-- KEYS[2] alive   (zset: worker id -> when it counts as gone, ms)
-- KEYS[3] calls   (hash: worker id -> its last dispatch call, see dispatch.lua)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] worker id
-- ARGV[3] its description, JSON without the closing brace
-- ARGV[4] how long it counts as alive without another heartbeat (ms)
-- ARGV[5] 1 to say it is leaving (remove it) instead
--
-- A worker killed without a word leaves no one to remove it: the next
-- heartbeat of any worker of the queue removes at most 20 such entries
-- (bounded work), so the hash never grows with crashes.
-- Returns the number of gone workers removed.

-- @include clock

local now = clock_ms(ARGV[1])
if ARGV[5] == '1' then
  redis.call('HDEL', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
else
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3] .. ',"seen_ms":' .. now .. '}')
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[2])
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now, 'LIMIT', 0, 20)
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
  redis.call('HDEL', KEYS[3], unpack(gone))
end
return #gone
