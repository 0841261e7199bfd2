-- add: create jobs (one or many), honouring idempotency keys.
--
-- KEYS[1] seq   KEYS[2] waiting   KEYS[3] delayed   KEYS[4] events
-- KEYS[5] wake  KEYS[6] stats     KEYS[7] job key prefix  KEYS[8] budget key prefix
-- KEYS[8 + k]   the k-th idempotency key named by the jobs below
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] events stream max length  ARGV[3] idempotency TTL (ms)
-- ARGV[4] number of jobs n
-- ARGV[3 + 2 * i] job i's options, packed: a JSON array of strings laid out as ADDED (the
--   include 'wire', generated from engine/wireformat.py): name, priority, delay (ms),
--   max_attempts, backoff (JSON), timeout (ms, 0 = worker default), max_stalls, token
--   estimate, budget name ('' = none), on_exhausted ('reject' | 'wait'), correlation id
--   ('' = none), idempotency key index k ('0' = none), trace context ('' = none: a W3C
--   traceparent, checked by the caller, stored as is), the caller's job id ('' = none: the
--   queue's sequence number is the id; checked by the caller never to be all digits, so
--   it names no job the sequence made)
-- ARGV[4 + 2 * i] job i's payload (JSON), as it is
--
-- A job added under an idempotency key says so in its 'added' event ('idem', the key), so
-- that a reader of the stream can tell which job it is without reading the job.
--
-- Returns {id_1, created_1, id_2, created_2, ...}: created is 1 for a new job
-- and 0 when an idempotency key already named a job (its id is returned) or the
-- caller's id names a job the queue still holds;
-- or {-1, budget} when a job names a budget that does not exist: then
-- nothing at all is written. (A budget name is checked by the caller, so the
-- key it makes stays in this queue's slot.)
-- Every job takes the queue's next sequence number, for its waiting score:
-- priority * 2^32 + (sequence mod 2^32), lower priority first, FIFO within one; and
-- the number is its id when the caller gave none.

-- @include clock
-- @include emit
-- @include wire

local now = clock_ms(ARGV[1])
local maxlen = ARGV[2]
local idem_ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local jobs = {}
local checked = {}
for i = 1, n do
  local o = cjson.decode(ARGV[3 + 2 * i])
  jobs[i] = o
  local budget = o[ADDED.budget]
  if budget ~= '' and not checked[budget] then
    if redis.call('EXISTS', KEYS[8] .. budget) == 0 then return {-1, budget} end
    checked[budget] = true
  end
end

local out = {}
local added = 0
for i = 1, n do
  local o = jobs[i]
  local idem_k = tonumber(o[ADDED.idem_key])
  local given = o[ADDED.job_id]
  local existing = false
  if idem_k > 0 then existing = redis.call('GET', KEYS[8 + idem_k]) end
  if not existing and given ~= '' and redis.call('EXISTS', KEYS[7] .. given) == 1 then existing = given end
  if existing then
    out[#out + 1] = existing
    out[#out + 1] = 0
  else
    local seq = redis.call('INCR', KEYS[1])
    local id = given
    if id == '' then id = tostring(seq) end
    local priority = o[ADDED.priority]
    local score = string.format('%.0f', tonumber(priority) * 4294967296 + (seq % 4294967296))
    local delay = tonumber(o[ADDED.delay_ms])
    local state = 'waiting'
    if delay > 0 then state = 'delayed' end
    local jk = KEYS[7] .. id
    redis.call('HSET', jk, 'v', 1, 'name', o[ADDED.name], 'payload', ARGV[4 + 2 * i],
      'priority', priority, 'score', score, 'state', state, 'attempt', 0, 'token', 0,
      'failures', 0, 'stalls', 0, 'max_attempts', o[ADDED.max_attempts],
      'backoff', o[ADDED.backoff], 'timeout_ms', o[ADDED.timeout_ms],
      'max_stalls', o[ADDED.max_stalls], 'created', now, 'tokens', o[ADDED.tokens])
    local budget = o[ADDED.budget]
    if budget ~= '' then redis.call('HSET', jk, 'budget', budget, 'on_ex', o[ADDED.on_exhausted]) end
    local cid = o[ADDED.correlation_id]
    if cid ~= '' then redis.call('HSET', jk, 'cid', cid) end
    local trace = o[ADDED.trace_context]
    if trace ~= '' then redis.call('HSET', jk, 'trace', trace) end
    if delay > 0 then
      redis.call('HSET', jk, 'due', now + delay)
      redis.call('ZADD', KEYS[3], now + delay, id)
    else
      redis.call('ZADD', KEYS[2], score, id)
    end
    if idem_k > 0 then
      redis.call('HSET', jk, 'idem', KEYS[8 + idem_k])
      redis.call('SET', KEYS[8 + idem_k], id, 'PX', idem_ttl)
      emit(KEYS[4], maxlen, 'added', id, 'state', state, 'idem', KEYS[8 + idem_k])
    else
      emit(KEYS[4], maxlen, 'added', id, 'state', state)
    end
    added = added + 1
    out[#out + 1] = id
    out[#out + 1] = 1
  end
end
if added > 0 then
  -- A delayed job also wakes a worker: it may need to shorten its block.
  redis.call('ZADD', KEYS[5], 0, 'w')
  redis.call('HINCRBY', KEYS[6], 'added', added)
end
return out
