-- purge: delete dead-lettered jobs for good.
--
-- KEYS[1] dead   KEYS[1 + i] job key of the i-th job
-- ARGV[i] id of the i-th job
--
-- Returns the number of entries removed from the dead-letter queue. A job that
-- is no longer dead (redriven meanwhile) is left alone; an entry whose record
-- is already gone is removed.

local removed = 0
for i = 1, #KEYS - 1 do
  local state = redis.call('HGET', KEYS[1 + i], 'state')
  if state == 'dead' or not state then
    if state then redis.call('DEL', KEYS[1 + i]) end
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed
