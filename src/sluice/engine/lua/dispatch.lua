-- dispatch: record the outcomes of a batch of leased jobs (possibly none),
-- promote due delayed jobs, then take up to N best waiting jobs.
-- One call per worker round trip: finishing first frees the slots that the
-- dispatch step after it may fill.
--
-- KEYS[1] waiting   KEYS[2] delayed   KEYS[3] active   KEYS[4] events
-- KEYS[5] stats     KEYS[6] wake      KEYS[7] job key prefix   KEYS[8] dead
-- KEYS[9 .. 15]     flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[15 + i]      job key of the i-th finished job
-- ARGV[1] now (ms)  ARGV[2] max jobs to take  ARGV[3] lease (ms)  ARGV[4] worker id
-- ARGV[5] events stream max length  ARGV[6] keep finished records (ms, 0 = forever)
-- ARGV[7] largest result copied into the 'completed' event (bytes)
-- ARGV[8] number of finished jobs n
-- ARGV[9 + 6 * (i - 1) ...] per finished job: id, token, kind, value, retry_at (ms),
--   tokens used (-1 = not reported)
--
-- Returns {n, code_1..code_n, next_due, <9 values per taken job>...}
-- (codes: see includes/finish.lua; next_due and jobs: see includes/dispatch.lua).

-- @include emit
-- @include wake
-- @include ledger
-- @include dispatch
-- @include finish

local K = {waiting = KEYS[1], delayed = KEYS[2], active = KEYS[3], events = KEYS[4],
           stats = KEYS[5], jobp = KEYS[7], dead = KEYS[8], maxlen = ARGV[5],
           keep_ms = tonumber(ARGV[6]), ev_result_max = tonumber(ARGV[7])}
with_flow_keys(K, 9)
local now = tonumber(ARGV[1])
local max_jobs = tonumber(ARGV[2])
local n = tonumber(ARGV[8])
local C = new_counts()
local out = {n}
for i = 1, n do
  local a = 9 + 6 * (i - 1)
  out[i + 1] = finish_one(K, KEYS[15 + i], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
                          tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), now, C)
end
promote_due(K, now)
local at = #out + 1
out[at] = 0
local G = load_gates(K, now)
local taken, wait = take_jobs(K, G, now, max_jobs, tonumber(ARGV[3]), ARGV[4], out, C)
flush_counts(K.stats, C)
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
return out
