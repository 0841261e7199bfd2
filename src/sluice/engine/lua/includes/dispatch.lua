-- The dispatch step shared by dispatch.lua and finish.lua: admission control.
--
-- load_gates(K, now) -> G: the queue's flow controls, read once per call.
-- promote_due(K, G, now): moves delayed jobs whose time has come to waiting, at
--   the waiting score they were given when added (their place in line), and
--   jobs parked on a budget that may have room again (its window turned or
--   rolled, tokens came back, its limit rose) as far as that room admits them.
-- queue_wait(K, G, now): 0 if the queue-wide gates admit a job now; else when
--   they may (ms), or -1 if only an event can open them (resume, a freed slot).
-- take_jobs(K, G, now, max_jobs, lease_ms, worker, out, C) -> taken, wait:
--   takes up to max_jobs waiting jobs, best first, each only if every gate
--   admits it: not paused or throttled, below the global concurrency, room in
--   the request-rate window, in the token-rate window and in the job's
--   budget(s), reserved at once on every level. A job whose budget refuses it
--   is rejected or parked (its on_exhausted policy) and the next one is
--   considered; a queue-wide gate stops the step (strict priority order).
--   At most EXAMINE_MAX jobs are looked at; a call stopped there with jobs
--   still waiting answers wait = now (come back at once).
--   Appends LEASED_FIELDS values per job to `out`, at the offsets LEASED
--   names (the wire include: engine/wireformat.py says what each value is).
--   `wait` is 0 when nothing refused, else as for queue_wait.
--   Each gate that refuses is noted in G.refused (paused, throttled,
--   concurrency, rate, token_rate, budget).
--   The request-rate and token-rate limits each have two parts: the exact log
--   (the starts zset; the '#tpm' rolling budget), counted over W + h (the
--   headroom: the larger of control 'headroom_ms', 10 unless set, and the
--   workers' measured 'lag_h'), is the hard cap; a pacer (a GCRA with
--   tolerance tau, control 'tolerance_ms', 'off' for none) spaces the starts
--   (W + h) / N apart, per request or per token. A job starts only when the
--   pacer's theoretical arrival time (control 'tat_req', 'tat_tok': us) is at
--   most tau away; its start moves that time on by its cost. A pacer's
--   refusal counts as its limit's (rate, token_rate), and its wait is tat - tau.
--   The times are written back with one HSET per call.
--   Each kind may have up to two longer windows beside the paced one, hard
--   caps with no pacer (control 'rate_caps': 'ms:limit ...', counted on the
--   same starts log; control 'tok_caps': 'ms ...', each the rolling budget
--   '#tok:<ms>', reserved on beside '#tpm'), counted over their W + h too. A
--   full request window opens when its N-th newest start leaves it.
-- count_refusals(K, G, max_jobs): adds the noted gates to the stats hash
--   ('refused:<gate>', one HINCRBY each): dispatch calls each gate refused.
-- next_due(K, wait): the earliest time something may become runnable without
--   any other event: a delayed job, a parked budget's retry time, or `wait`.
--
-- K is a table of key names: waiting, delayed, active, events, stats, jobp
-- (the job key prefix; job keys are jobp .. id, ids produced by Redis itself),
-- control, starts, and the ledger's prefixes (see ledger.lua): budp, logp,
-- resvp, parkp (parked jobs of one budget: parkp .. name) and parkedby (budget
-- name -> when its parked jobs may be tried again). K.maxlen too, and what
-- retention.lua needs (retention, finp, dead).

-- @include wire
-- @include pacer
-- @include ledger
-- @include retention

-- The most work one call may do (docs/architecture.md, "Bounded work"): Redis
-- serves nobody while a script runs, so no loop here grows with a queue.
local PROMOTE_MAX = 100   -- delayed jobs promoted
local UNPARK_BUDGETS = 2  -- budgets whose parked jobs are tried again
local UNPARK_MAX = 50     -- parked jobs looked at per such budget
local EXAMINE_MAX = 40    -- units of take_jobs' work: a job looked at is 1, each level it charges 2

-- The job's budget and those above it, loaded once per script call.
local function cached_chain(K, G, name, now)
  local c = G.cache[name]
  if c == nil then
    local chain, missing = budget_chain(K, name, now)
    c = {chain = chain, missing = missing}
    -- Budgets met again through another job's chain must be the same tables,
    -- so a reservation made for one job is seen by the next.
    if chain then
      for i = 1, #chain do
        local seen = G.cache['#level:' .. chain[i].name]
        if seen then chain[i] = seen else G.cache['#level:' .. chain[i].name] = chain[i] end
      end
    end
    G.cache[name] = c
  end
  return c.chain, c.missing
end

-- When budget `b` (with the levels above it in `chain`) may admit `need`
-- tokens, computed once per budget per call (for the first need asked):
-- the retry time only says when to look again, and the look re-decides.
local function cached_retry_at(K, G, b, need, now)
  local key = '#retry:' .. b.name
  local at = G.cache[key]
  if at == nil then
    at = budget_retry_at(K, b, need, now)
    G.cache[key] = at
  end
  return at
end

-- Moves the jobs parked on budget `name` that its room (and every level
-- above it) can admit back to waiting, in their place in line: at most
-- UNPARK_MAX looked at, best first. Those that do not fit stay parked, and
-- the budget's retry time becomes when the first of them may fit besides
-- those moved (or now, if the look stopped at its bound). Returns the number
-- moved. A job that fitted but loses its room to a better one on the way is
-- parked again by take_jobs, without an event.
local function unpark_some(K, G, name, now)
  local pk = K.parkp .. name
  local chain = cached_chain(K, G, name, now)
  local room = nil -- no budget any more: every job goes back, and dispatch rejects it
  if chain then
    room = chain[1].limit - chain[1].used
    for i = 2, #chain do room = math.min(room, chain[i].limit - chain[i].used) end
  end
  local head = redis.call('ZRANGE', pk, 0, UNPARK_MAX - 1, 'WITHSCORES')
  local moved, taken, blocked = 0, 0, nil
  for i = 1, #head, 2 do
    local id = head[i]
    local jk = K.jobp .. id
    local f = redis.call('HMGET', jk, 'state', 'tokens')
    local need = math.max(math.floor(tonumber(f[2]) or 0), 0)
    if f[1] ~= 'parked' then
      redis.call('ZREM', pk, id) -- a stale entry (record gone or changed by hand)
    elseif room == nil or need <= room then
      if room then room, taken = room - need, taken + need end
      redis.call('ZREM', pk, id)
      redis.call('HSET', jk, 'state', 'waiting')
      redis.call('ZADD', K.waiting, head[i + 1], id)
      moved = moved + 1
    elseif blocked == nil then
      blocked = need
    end
  end
  if redis.call('EXISTS', pk) == 0 then
    redis.call('ZREM', K.parkedby, name)
  elseif blocked == nil then
    redis.call('ZADD', K.parkedby, now, name) -- stopped at the bound: more next call
  else
    -- The first that did not fit needs its tokens on top of those just moved back.
    local need = taken + blocked
    local at = cached_retry_at(K, G, refusing_level(chain, need), need, now)
    if at < 0 then at = '+inf' end
    redis.call('ZADD', K.parkedby, at, name)
  end
  if moved > 0 then emit(K.events, K.maxlen, 'unparked', '', 'budget', name) end
  return moved
end

local function promote_due(K, G, now)
  local names = redis.call('ZRANGEBYSCORE', K.parkedby, '-inf', now, 'LIMIT', 0, UNPARK_BUDGETS)
  for i = 1, #names do unpark_some(K, G, names[i], now) end
  local due = redis.call('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, PROMOTE_MAX)
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

-- The pacer's tolerance when none is set (ms): a worker that comes a little
-- late takes the starts it owes at once instead of losing them.
local PACE_TOLERANCE_MS = 20
-- The least headroom when none is set (ms): the workers' measured spread of
-- dispatch-to-send delays (control 'lag_h', see lag.lua) is used when larger
-- (docs/architecture.md, "The pacer").
local PACE_HEADROOM_MS = 10
-- The most the measured headroom may be (lag.lua's LAG_MAX_MS).
local LAG_KEEP_MS = 500
-- Windows per kind (requests, tokens) at most: the paced one and two caps (pace.lua's).
local WINDOWS_MAX = 3

local function load_gates(K, now)
  local f = redis.call('HMGET', K.control, 'paused', 'throttled_until', 'concurrency', 'rate_max',
                       'rate_ms', 'tpm', 'tolerance_ms', 'headroom_ms', 'tat_req', 'tat_tok', 'lag_h',
                       'slow_pm', 'slow_at', 'tpm_ms', 'rate_caps', 'tok_caps')
  local G = {paused = f[1] == '1', until_ms = tonumber(f[2]) or 0, conc = tonumber(f[3]),
             rate_max = tonumber(f[4]), rate_ms = tonumber(f[5]) or 0, tpm = nil, cache = {},
             refused = {}, paced = false,
             headroom = math.max(tonumber(f[8]) or PACE_HEADROOM_MS, tonumber(f[11]) or 0),
             -- The pacers' theoretical arrival times, in microseconds of the clock.
             now_us = now * 1000, tat_req = tonumber(f[9]) or 0, tat_tok = tonumber(f[10]) or 0}
  G.pace = f[7] ~= 'off'
  G.slow = slow_now(f[12], f[13], slow_recover_ms(f[5], f[14]), now)
  G.tau_us = (tonumber(f[7]) or PACE_TOLERANCE_MS) * 1000
  if G.conc then G.active = redis.call('ZCARD', K.active) end
  if G.rate_max then
    -- The log counts over W + h (the headroom): the hard cap.
    G.rate_win = G.rate_ms + G.headroom
    -- Counted, not pruned, to be exact: ZCOUNT is O(log n) however many starts
    -- have just left the window; they are removed at most LOG_PRUNE_MAX per call.
    G.starts = redis.call('ZCOUNT', K.starts, '(' .. (now - G.rate_win), '+inf')
    -- The caps: longer windows counted on the same log, which keeps the longest.
    G.rate_caps = {}
    -- Kept a window longer than the paced one counts, for observe.lua, which
    -- compares a provider's answer with the log as it was at the call's dispatch.
    local keep = G.rate_win + G.rate_ms
    for ms, n in string.gmatch(f[15] or '', '(%d+):(%d+)') do
      if #G.rate_caps < WINDOWS_MAX - 1 then
        local cap = {win = tonumber(ms) + G.headroom, max = tonumber(n)}
        cap.starts = redis.call('ZCOUNT', K.starts, '(' .. (now - cap.win), '+inf')
        G.rate_caps[#G.rate_caps + 1] = cap
        keep = math.max(keep, cap.win)
      end
    end
    -- And LAG_KEEP_MS longer still: a measured headroom that grows counts the
    -- starts it reaches back to.
    local prune = now - keep - LAG_KEEP_MS
    local old = redis.call('ZRANGE', K.starts, LOG_PRUNE_MAX - 1, LOG_PRUNE_MAX - 1, 'WITHSCORES')
    if #old > 0 and tonumber(old[2]) <= prune then
      redis.call('ZREMRANGEBYRANK', K.starts, 0, LOG_PRUNE_MAX - 1)
    else
      redis.call('ZREMRANGEBYSCORE', K.starts, '-inf', prune)
    end
  end
  if f[6] == '1' then
    G.tpm = load_budget(K, '#tpm', now)
    -- Every token window, the paced one first, then the caps (shortest first).
    G.tok = {G.tpm}
    for ms in string.gmatch(f[16] or '', '%d+') do
      if #G.tok < WINDOWS_MAX then
        local b = load_budget(K, '#tok:' .. ms, now)
        if b then
          b.per_ms = tonumber(ms)
          G.tok[#G.tok + 1] = b
        end
      end
    end
  end
  return G
end

-- The gate that refused this call, noted once per gate (see count_refusals).
local function refused(G, gate)
  G.refused[gate] = true
end

-- A request window of `win` ms holding `count` starts of its `max`: `wait`, or
-- if it is full, the later of `wait` and when it opens: when its N-th newest
-- start leaves it (the oldest may not be enough: a limit lowered leaves more
-- than N in it). By rank: O(log n).
local function window_wait(K, count, max, win, wait)
  if count < max then return wait end
  local nth = redis.call('ZRANGE', K.starts, -max, -max, 'WITHSCORES')
  return math.max(wait, tonumber(nth[2]) + win)
end

local function queue_wait(K, G, now)
  if G.paused then refused(G, 'paused'); return -1 end
  if G.until_ms > now then refused(G, 'throttled'); return G.until_ms end
  if G.conc and G.active >= G.conc then refused(G, 'concurrency'); return -1 end
  if G.rate_max then
    local wait = window_wait(K, G.starts, G.rate_max, G.rate_win, pace_wait(G, G.tat_req))
    for i = 1, #G.rate_caps do
      local cap = G.rate_caps[i]
      wait = window_wait(K, cap.starts, cap.max, cap.win, wait)
    end
    if wait ~= 0 then refused(G, 'rate'); return wait end
  end
  return 0
end

-- A job refused before it ever spent ends 'rejected'; one whose earlier
-- attempts spent tokens (then failed, were throttled or lost) ends
-- 'exhausted': its budget refused to run it again.
local function reject_job(K, jk, id, reason, now, C)
  local spent = tonumber(redis.call('HGET', jk, 'spent')) or 0
  if spent > 0 then
    redis.call('HSET', jk, 'state', 'exhausted', 'finished', now, 'error', reason)
    retain(K, 'exhausted', jk, id, now)
    C.exhausted = C.exhausted + 1
    emit(K.events, K.maxlen, 'exhausted', id, 'reason', reason, 'spent', spent)
    return
  end
  redis.call('HSET', jk, 'state', 'rejected', 'finished', now, 'error', reason)
  retain(K, 'rejected', jk, id, now)
  C.rejected = C.rejected + 1
  emit(K.events, K.maxlen, 'rejected', id, 'reason', reason)
end

-- A job that was parked on the same budget before (and not leased since)
-- goes back without an event: one 'parked' event per wait, not per look.
local function park_job(K, G, jk, id, score, b, need, was_on, now)
  redis.call('ZADD', K.parkp .. b.name, score, id)
  redis.call('HSET', jk, 'state', 'parked', 'parked', b.name)
  local at = cached_retry_at(K, G, b, need, now)
  if at < 0 then at = '+inf' end
  redis.call('ZADD', K.parkedby, 'LT', at, b.name)
  if was_on ~= b.name then emit(K.events, K.maxlen, 'parked', id, 'budget', b.name) end
end

-- Gates that depend on the job: the token-rate window and its budget(s).
-- Returns 'take' and the levels to reserve on; 'skip' (rejected or parked);
-- or 'block' and when the queue may go on (the token-rate window is full).
local function admit_job(K, G, jk, id, f, score, now, C)
  -- A hand-edited record must not credit budgets (negative) or leave a
  -- charge that never expires (fractional).
  local tokens = math.max(math.floor(tonumber(f[R.tokens]) or 0), 0)
  local levels = {}
  local tpm = G.tpm
  if tpm then
    for i = 1, #G.tok do
      local b = G.tok[i]
      if tokens > b.limit then
        refused(G, 'token_rate')
        local per = ''
        if b.per_ms then per = ' per ' .. (b.per_ms / 1000) .. ' s' end
        reject_job(K, jk, id, 'token estimate ' .. tokens .. ' exceeds the queue token-rate limit of '
                   .. b.limit .. per .. '; split the job or raise the limit', now, C)
        return 'skip'
      end
    end
    -- A job that costs no tokens is not paced by them.
    local wait = 0
    if tokens > 0 then wait = pace_wait(G, G.tat_tok) end
    for i = 1, #G.tok do
      local b = G.tok[i]
      if b.used + tokens > b.limit then
        local at = now -- while 'used' still counts charges that left
        if not b.behind then at = roll_free_at(K, b, tokens) end
        if at < 0 or wait < 0 then wait = -1 else wait = math.max(wait, at) end
      end
    end
    if wait ~= 0 then
      refused(G, 'token_rate')
      return 'block', wait
    end
  end
  local budget = f[R.budget]
  if budget then
    local chain, missing = cached_chain(K, G, budget, now)
    if not chain then
      refused(G, 'budget')
      reject_job(K, jk, id, 'no budget named ' .. missing .. '; create it before adding jobs that use it',
                 now, C)
      return 'skip'
    end
    local refusing = refusing_level(chain, tokens)
    if refusing then
      refused(G, 'budget')
      -- A level still counting charges that left its window refuses nothing
      -- yet: the step stops, and the caller comes back at once.
      for i = 1, #chain do
        if chain[i].behind then return 'block', now end
      end
      if f[R.on_ex] == 'wait' then
        park_job(K, G, jk, id, f[R.score] or score, refusing, tokens, f[R.parked], now)
      else
        reject_job(K, jk, id, 'budget ' .. refusing.name .. ' cannot admit ' .. tokens .. ' tokens ('
                   .. math.max(refusing.limit - refusing.used, 0) .. ' of ' .. refusing.limit
                   .. ' left)', now, C)
        redis.call('HINCRBY', refusing.key, 'rejected', 1)
      end
      return 'skip'
    end
    for i = 1, #chain do levels[#levels + 1] = chain[i] end
  end
  if tpm then
    for i = 1, #G.tok do levels[#levels + 1] = G.tok[i] end
  end
  return 'take', levels
end

local function take_some(K, G, now, max_jobs, lease_ms, worker, out, C)
  local wait = queue_wait(K, G, now)
  if max_jobs <= 0 or wait ~= 0 then
    -- A closed gate refuses nothing while nothing waits.
    if wait ~= 0 and redis.call('EXISTS', K.waiting) == 0 then G.refused = {} end
    return 0, wait
  end
  local taken, examined = 0, 0
  local deadline = now + lease_ms
  -- Without a queue-wide limit nothing can stop the step half way, so the
  -- jobs are popped at once (ZPOPMIN), as cheap as a queue without gates;
  -- with one, each is looked at (ZRANGE) and removed only once decided.
  local gated = G.conc or G.rate_max or G.tpm
  while taken < max_jobs and examined < EXAMINE_MAX do
    local head
    -- A batch is examined whole, and a job that charges a budget weighs 3: a batch
    -- is as large as the bound can take if every job in it does.
    local n = math.min(max_jobs - taken, math.max(1, math.floor((EXAMINE_MAX - examined) / 3)))
    if gated then
      head = redis.call('ZRANGE', K.waiting, 0, n - 1, 'WITHSCORES')
    else
      head = redis.call('ZPOPMIN', K.waiting, n)
    end
    if #head == 0 then break end
    for i = 1, #head, 2 do
      if gated then
        wait = queue_wait(K, G, now)
        if wait ~= 0 then return taken, wait end
      end
      examined = examined + 1
      local id = head[i]
      local jk = K.jobp .. id
      local f = read_leasable(jk)
      if not f[R.name] then
        -- The record is gone (deleted by hand, or evicted): nothing to run.
        if gated then redis.call('ZREM', K.waiting, id) end
        C.orphaned = C.orphaned + 1
      else
        local verdict, levels = admit_job(K, G, jk, id, f, head[i + 1], now, C)
        if verdict == 'block' then
          if not gated then
            -- Popped already (ZPOPMIN): this job and the rest of the batch go back.
            for j = i, #head, 2 do redis.call('ZADD', K.waiting, head[j + 1], head[j]) end
          end
          return taken, levels
        end
        if gated then redis.call('ZREM', K.waiting, id) end
        if verdict == 'take' then
          -- Counters that do not parse (a record damaged by another writer) restart
          -- from zero rather than fail the whole call; the worker checks the rest.
          local attempt = (tonumber(f[R.attempt]) or 0) + 1
          local token = (tonumber(f[R.token]) or 0) + 1
          redis.call('HSET', jk, 'state', 'active', 'started', now, 'worker', worker,
                     'attempt', attempt, 'token', token)
          if f[R.parked] then redis.call('HDEL', jk, 'parked') end
          if #levels > 0 then
            local rid = id .. ':' .. token
            reserve(K, rid, id, levels, math.max(math.floor(tonumber(f[R.tokens]) or 0), 0), now)
            redis.call('HSET', jk, 'rid', rid)
            examined = examined + 2 * #levels -- a reservation costs about twice a plain lease
          end
          redis.call('ZADD', K.active, deadline, id)
          if G.conc then G.active = G.active + 1 end
          if G.rate_max then
            redis.call('ZADD', K.starts, now, id .. ':' .. token)
            G.starts = G.starts + 1
            for c = 1, #G.rate_caps do G.rate_caps[c].starts = G.rate_caps[c].starts + 1 end
            if G.pace then G.tat_req = pace_next(G, G.tat_req, 1, G.rate_win, G.rate_max) end
          end
          if G.tpm and G.pace then
            local need = math.max(math.floor(tonumber(f[R.tokens]) or 0), 0)
            G.tat_tok = pace_next(G, G.tat_tok, need, G.tpm.win_ms, G.tpm.limit)
          end
          if G.pace and (G.rate_max or G.tpm) then G.paced = true end
          emit(K.events, K.maxlen, 'active', id, 'worker', worker, 'attempt', attempt, 'token', token)
          put_leased(out, f, id, token, attempt)
          taken = taken + 1
        end
      end
    end
  end
  -- Stopped at the bound with work left: the caller is told to come back now.
  if taken < max_jobs and examined >= EXAMINE_MAX and redis.call('ZCARD', K.waiting) > 0 then
    return taken, now
  end
  return taken, 0
end

local function take_jobs(K, G, now, max_jobs, lease_ms, worker, out, C)
  local taken, wait = take_some(K, G, now, max_jobs, lease_ms, worker, out, C)
  if G.paced then
    -- The pacers' times, written once per call however many jobs it leased.
    local a = {}
    if G.rate_max then a[#a + 1] = 'tat_req'; a[#a + 1] = G.tat_req end
    if G.tpm then a[#a + 1] = 'tat_tok'; a[#a + 1] = G.tat_tok end
    redis.call('HSET', K.control, unpack(a))
  end
  return taken, wait
end

-- Adds 1 to the stats hash's 'refused:<gate>' for each gate that refused
-- during this call: at most one HINCRBY per gate (six gates), however many
-- jobs were looked at. A caller that asked for no jobs is refused nothing.
local function count_refusals(K, G, max_jobs)
  if max_jobs <= 0 then return end
  for gate in pairs(G.refused) do redis.call('HINCRBY', K.stats, 'refused:' .. gate, 1) end
end

local function next_due(K, wait)
  local due = -1
  local first = redis.call('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
  if #first > 0 then due = tonumber(first[2]) end
  local parked = redis.call('ZRANGE', K.parkedby, 0, 0, 'WITHSCORES')
  if #parked > 0 and parked[2] ~= 'inf' then
    local at = tonumber(parked[2])
    if due < 0 or at < due then due = at end
  end
  if wait > 0 and (due < 0 or wait < due) then due = wait end
  return due
end
