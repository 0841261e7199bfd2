-- trim: forget finished jobs past the queue's retention (includes/retention.lua),
-- oldest first, at most ARGV[2] of them in one call.
--
-- KEYS[1] retention   KEYS[2] prefix of the finished:<kind> sets   KEYS[3] dead
-- KEYS[4] job key prefix   KEYS[5] reservation prefix
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] most jobs to forget
--
-- Per kind, the jobs that finished longer ago than its age, then the oldest
-- beyond its count. Forgetting a job deletes its record and its last
-- attempt's settled reservation. Its idempotency key stays until its own TTL:
-- a producer that retries an add it is unsure of must not start the work a
-- second time because the first job's record is gone (the add answers with
-- the old id, whose record is not found). An
-- index entry whose record is in another state now (a dead job redriven, in
-- the index of an older Sluice) or already expired only leaves the index.
-- Returns {jobs forgotten, 1 if more are due (the call stopped at its bound)}.

-- @include clock
-- @include retention

local K = {retention = KEYS[1], finp = KEYS[2], dead = KEYS[3]}
local jobp, resvp = KEYS[4], KEYS[5]
local now = clock_ms(ARGV[1])
local room = tonumber(ARGV[2])
local forgotten, more = 0, 0

local function forget(kind, set, ids)
  for _, id in ipairs(ids) do
    local jk = jobp .. id
    local f = redis.call('HMGET', jk, 'state', 'rid')
    if f[1] == kind then
      if f[2] then redis.call('DEL', resvp .. f[2]) end
      redis.call('DEL', jk)
    end
    redis.call('ZREM', set, id)
  end
  forgotten = forgotten + #ids
  room = room - #ids
end

for _, kind in ipairs(RETENTION_KINDS) do
  if room <= 0 then
    more = 1
    break
  end
  local r = retention(K)[kind]
  local set = finished_set(K, kind)
  if r.age > 0 then
    forget(kind, set, redis.call('ZRANGEBYSCORE', set, '-inf', now - r.age, 'LIMIT', 0, room))
    if room <= 0 then
      -- A full batch: there may be more of this kind (or the next) to forget.
      more = 1
      break
    end
  end
  if r.count > 0 then
    local over = redis.call('ZCARD', set) - r.count
    if over > 0 then
      local take = math.min(over, room)
      forget(kind, set, redis.call('ZRANGE', set, 0, take - 1))
      if over > take then more = 1 end
    end
  end
end
return {forgotten, more}
