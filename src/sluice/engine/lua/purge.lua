-- purge: delete dead-lettered jobs for good.
--
-- KEYS[1] dead   KEYS[2] reservation prefix   KEYS[2 + i] job key of the i-th job
-- ARGV[i] id of the i-th job
--
-- Returns the number of entries removed from the dead-letter queue. A job that
-- is no longer dead (redriven meanwhile) is left alone; an entry whose record
-- is already gone is removed. A purged job takes its last reservation with it,
-- as trim.lua's do; its idempotency key stays until its own TTL (see trim.lua).

local removed = 0
for i = 1, #KEYS - 2 do
  local jk, id = KEYS[2 + i], ARGV[i]
  local f = redis.call('HMGET', jk, 'state', 'rid')
  if f[1] == 'dead' or not f[1] then
    if f[1] then
      if f[2] then redis.call('DEL', KEYS[2] .. f[2]) end
      redis.call('DEL', jk)
    end
    removed = removed + redis.call('ZREM', KEYS[1], id)
  end
end
return removed
