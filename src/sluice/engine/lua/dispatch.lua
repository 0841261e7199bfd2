-- dispatch: record the outcomes of a batch of leased jobs (possibly none),
-- promote due delayed jobs, then take up to N best waiting jobs.
-- One call per worker round trip: finishing first frees the slots that the
-- dispatch step after it may fill.
--
-- KEYS[1] waiting   KEYS[2] delayed   KEYS[3] active   KEYS[4] events
-- KEYS[5] stats (the cumulative counters, and refused:<gate>: see count_refusals)
-- KEYS[6] wake      KEYS[7] job key prefix   KEYS[8] dead
-- KEYS[9 .. 15]     flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[16] calls    (hash: worker id -> its last call's request id, codes and leases)
-- KEYS[17] epoch    (string: the queue's epoch, made here if missing)
-- KEYS[18] retention   KEYS[19] prefix of the finished:<kind> sets (see includes/retention.lua)
-- KEYS[19 + i]      job key of the i-th finished job
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] max jobs to take  ARGV[3] lease (ms)  ARGV[4] worker id
-- ARGV[5] events stream max length
-- ARGV[6] largest result copied into the 'completed' event (bytes)
-- ARGV[7] number of finished jobs n
-- ARGV[8] request id ('' = none): a call sent again with the id of the worker's
--   last call (its reply was lost) is answered from what that call did, not
--   run again: the same codes, and the jobs it leased that are still leased
--   to it, re-read (see replay below)
-- ARGV[9 + 6 * (i - 1) ...] per finished job: id, token, kind, value, retry in (ms from
--   now, for kind 'f'), tokens used (-1 = not reported)
--
-- Returns {n, code_1..code_n, next_due, now, epoch, <LEASED_FIELDS values per taken job>...}
-- (codes: see includes/finish.lua; next_due: see includes/dispatch.lua; each job's
-- values: the wire include, generated from engine/wireformat.py;
-- now is the script's clock, so a worker can time next_due without trusting its own;
-- epoch names this life of the queue's data, so that provider idempotency keys
-- (prefix, queue, epoch, job id) never repeat after Redis lost its data and job
-- ids started again from 1).

-- @include clock
-- @include wire
-- @include emit
-- @include wake
-- @include ledger
-- @include dispatch
-- @include finish

-- The answer to a call whose reply was lost, from the record it left.
local function replay(K, rec, now, epoch)
  local out = {#rec.c}
  for i = 1, #rec.c do out[i + 1] = rec.c[i] end
  out[#out + 1] = next_due(K, 0)
  out[#out + 1] = now
  out[#out + 1] = epoch
  for i = 1, #rec.l, 2 do
    local id, token = rec.l[i], rec.l[i + 1]
    local f = read_leasable(K.jobp .. id)
    if f[R.state] == 'active' and f[R.token] == token then
      put_leased(out, f, id, tonumber(token), tonumber(f[R.attempt]))
    end
  end
  return out
end

local K = {waiting = KEYS[1], delayed = KEYS[2], active = KEYS[3], events = KEYS[4],
           stats = KEYS[5], jobp = KEYS[7], dead = KEYS[8], retention = KEYS[18], finp = KEYS[19],
           maxlen = ARGV[5], ev_result_max = tonumber(ARGV[6])}
with_flow_keys(K, 9)
local now = clock_ms(ARGV[1])
local max_jobs = tonumber(ARGV[2])
local n = tonumber(ARGV[7])
local epoch = redis.call('GET', KEYS[17])
if not epoch then
  -- First call, or Redis lost its data: a new epoch, unique by Redis's clock to
  -- the microsecond (Lua's random numbers repeat in scripts).
  local t = redis.call('TIME')
  epoch = string.sub(redis.sha1hex(t[1] .. '.' .. t[2] .. ' ' .. KEYS[17] .. ' ' .. ARGV[4]), 1, 16)
  redis.call('SET', KEYS[17], epoch)
end
local req = ARGV[8]
if req ~= '' then
  local prev = redis.call('HGET', KEYS[16], ARGV[4])
  if prev then
    local ok, rec = pcall(cjson.decode, prev)
    if ok and type(rec) == 'table' and rec.r == req then return replay(K, rec, now, epoch) end
  end
end
local C = new_counts()
local out = {n}
for i = 1, n do
  local a = 9 + 6 * (i - 1)
  out[i + 1] = finish_one(K, KEYS[19 + i], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
                          now + (tonumber(ARGV[a + 4]) or 0), tonumber(ARGV[a + 5]), now, C)
end
local G = load_gates(K, now)
promote_due(K, G, now)
local at = #out + 1
out[at] = 0
out[at + 1] = now
out[at + 2] = epoch
local taken, wait = take_jobs(K, G, now, max_jobs, tonumber(ARGV[3]), ARGV[4], out, C)
flush_counts(K.stats, C)
count_refusals(K, G, max_jobs)
-- Wake another worker only if the queue is open: a refused worker learns
-- when to come back (next_due), and a freed slot wakes one through the
-- finishing worker's own call. A caller that takes nothing hands the wake-up on.
if wait == 0 or (max_jobs <= 0 and wait > 0) then wake_if_waiting(K.waiting, KEYS[6]) end
local due = next_due(K, wait)
-- A caller that filled every slot it asked for may have none left to act on
-- `due` (a retry, a parked job's window, a gate's opening): an idle worker
-- is woken to learn it and keep the timer.
if due > 0 and max_jobs > 0 and taken >= max_jobs then redis.call('ZADD', KEYS[6], 0, 'w') end
out[at] = due
if req ~= '' then
  -- What this call did, kept (one record per worker, replaced by its next call)
  -- so that the same call sent again after a lost reply is answered, not redone.
  local codes, leases = {}, {}
  for i = 1, n do codes[i] = out[i + 1] end
  for i = at + 3, #out, LEASED_FIELDS do -- (each leased job's group: the wire include)
    leases[#leases + 1] = out[i - 1 + LEASED.id]
    leases[#leases + 1] = tostring(out[i - 1 + LEASED.token])
  end
  redis.call('HSET', KEYS[16], ARGV[4], cjson.encode({r = req, c = codes, l = leases}))
end
return out
