-- The dispatch step shared by dispatch.lua and finish.lua.
--
-- promote_due(K, now): moves delayed jobs whose time has come to waiting, at
--   the waiting score they were given when added (their place in line).
-- take_jobs(K, now, max_jobs, lease_ms, worker, maxlen, out): takes up to
--   max_jobs best waiting jobs, leases them to `worker` until now + lease_ms,
--   and appends 9 values per job to `out`:
--     id, token, name, payload, attempt, max_attempts, timeout_ms, backoff, created
-- next_due(K): the due time of the earliest delayed job, or -1.
--
-- K is a table of key names: waiting, delayed, active, events, stats, jobp
-- (the job key prefix; job keys are jobp .. id, ids produced by Redis itself).
--
-- Admission gates (concurrency, rates, budgets) belong in take_jobs, so that a
-- job is only ever taken when every gate admits it.

local function promote_due(K, now)
  local due = redis.call('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, 500)
  if #due == 0 then return 0 end
  for i = 1, #due do
    local jk = K.jobp .. due[i]
    local score = redis.call('HGET', jk, 'score')
    if score then
      redis.call('ZADD', K.waiting, score, due[i])
      redis.call('HSET', jk, 'state', 'waiting')
    end
  end
  redis.call('ZREM', K.delayed, unpack(due))
  return #due
end

local function take_jobs(K, now, max_jobs, lease_ms, worker, maxlen, out)
  if max_jobs <= 0 then return 0 end
  local popped = redis.call('ZPOPMIN', K.waiting, max_jobs)
  local taken, orphans = 0, 0
  local deadline = now + lease_ms
  for i = 1, #popped, 2 do
    local id = popped[i]
    local jk = K.jobp .. id
    local f = redis.call('HMGET', jk, 'name', 'payload', 'max_attempts', 'timeout_ms', 'backoff', 'created',
                         'attempt', 'token')
    if f[1] then
      -- Counters that do not parse (a record damaged by another writer) restart
      -- from zero rather than fail the whole call; the worker checks the rest.
      local attempt = (tonumber(f[7]) or 0) + 1
      local token = (tonumber(f[8]) or 0) + 1
      redis.call('HSET', jk, 'state', 'active', 'started', now, 'worker', worker,
                 'attempt', attempt, 'token', token)
      redis.call('ZADD', K.active, deadline, id)
      emit(K.events, maxlen, 'active', id, 'worker', worker)
      local n = #out
      out[n + 1] = id
      out[n + 2] = token
      out[n + 3] = f[1]
      out[n + 4] = f[2]
      out[n + 5] = attempt
      out[n + 6] = f[3]
      out[n + 7] = f[4]
      out[n + 8] = f[5]
      out[n + 9] = f[6]
      taken = taken + 1
    else
      -- The record is gone (deleted by hand, or evicted): nothing to run.
      orphans = orphans + 1
    end
  end
  if orphans > 0 then redis.call('HINCRBY', K.stats, 'orphaned', orphans) end
  return taken
end

local function next_due(K)
  local first = redis.call('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return tonumber(first[2])
end
