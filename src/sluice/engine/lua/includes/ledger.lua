-- The token ledger: budgets, their windows and hierarchy, and reservations.
--
-- A budget is a hash at K.budp .. name:
--   limit   tokens the budget may admit per window (or in all, without one)
--   used    tokens charged in the current window: held reservations + committed
--   win     '' (none), 'day' or 'month' (calendar, UTC), or 'roll' (rolling)
--   win_ms  the rolling window's length
--   period  the calendar window the 'used' figure belongs to (day or month number)
--   parent  name of the budget above it (a tenant under a team), or absent
--   credit  a one-off credit: tokens the current window admits beyond the limit
--   credit_p  the window the credit belongs to: the period (calendar), the
--           time it ends (rolling, ms), or 0 (no window: it never ends)
--   accepted / rejected / unknown   cumulative reservation counters
--   beyond  cumulative tokens charged beyond the estimates of reservations
--   charged cumulative tokens of settled reservations (committed or unknown
--           outcome): what the budget has spent since it was made, whatever
--           its windows; its rate is the burn rate
-- A rolling budget also has a log, a zset at K.logp .. name: member
-- '<amount> <reservation id>' -> time reserved; the charge leaves the window
-- (and 'used') win_ms later. The amount lives in the member, not only in the
-- reservation, so a charge still leaves correctly after the reservation
-- record has expired (a budget nobody touched for days).
--
-- A reservation is a hash at K.resvp .. rid:
--   amt     tokens charged on every level now (the estimate, then the actual)
--   est     tokens first reserved
--   b       the budget names charged, space separated, the job's own first
--   p       per budget the window it was charged in (period, or 0)
--   state   held | committed | refunded | unknown
--   beyond  tokens used beyond the estimate (charged in full, like the rest)
--   over    (written by Sluice before 0.2: usage beyond what the budgets could
--           still admit, which was not charged; read by nothing now)
-- Settling (commit or refund) a reservation that is no longer held changes
-- nothing, so both are idempotent.
--
-- A reservation charges the same amount on all of its levels, which keeps a
-- level's 'used' equal to the sum of its reservations' amounts; the one
-- exception is usage below the estimate, which the token-rate windows (the
-- budgets named '#...') keep counting unless the provider refunds it (see settle).

-- @include emit

-- Adds the flow-control and ledger key names, passed as KEYS[i] .. KEYS[i + 6]
-- by every script that uses them (see keys.py: QueueKeys.flow).
local function with_flow_keys(K, i)
  K.control, K.starts, K.budp, K.logp = KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3]
  K.resvp, K.parkp, K.parkedby = KEYS[i + 4], KEYS[i + 5], KEYS[i + 6]
  return K
end

-- Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- (year, month) of a day number.
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The calendar window of `now` (a day or month number) and when the next begins (ms).
local function period_of(win, now)
  local day = math.floor(now / 86400000)
  if win == 'day' then return day, (day + 1) * 86400000 end
  local y, m = civil_from_days(day)
  local nm, ny = m + 1, y
  if nm > 12 then nm, ny = 1, y + 1 end
  return y * 12 + (m - 1), days_from_civil(ny, nm, 1) * 86400000
end

-- Charges that leave a rolling window in one call, at most.
local LOG_PRUNE_MAX = 1000

-- The amount of a rolling log member ('<amount> <rid>').
local function log_amount(member)
  return tonumber(string.match(member, '^(%d+) ')) or 0
end

-- Loads one budget, moving it into the window that contains `now`; nil if absent.
local function load_budget(K, name, now)
  local bk = K.budp .. name
  local f = redis.call('HMGET', bk, 'limit', 'used', 'win', 'win_ms', 'period', 'parent', 'credit',
                       'credit_p')
  if not f[1] then return nil end
  local b = {name = name, key = bk, limit = tonumber(f[1]) or 0, used = tonumber(f[2]) or 0,
             win = f[3] or '', win_ms = tonumber(f[4]) or 0, period = tonumber(f[5]) or 0,
             parent = f[6], credit = 0}
  if b.win == 'day' or b.win == 'month' then
    local p = period_of(b.win, now)
    -- Only forward: a caller whose clock is a little behind must not start
    -- the window again (and forget what it holds).
    if p > b.period then
      b.period, b.used = p, 0
      redis.call('HSET', bk, 'period', p, 'used', 0)
    end
  elseif b.win == 'roll' then
    -- At most LOG_PRUNE_MAX charges leave per call (bounded work: a whole
    -- window can pass at once). Until the rest have left too, 'used' still
    -- counts them and the budget is 'behind': it may refuse nothing on that
    -- account (see admit_job), it only asks the caller to come back.
    local lk = K.logp .. name
    local gone = redis.call('ZRANGEBYSCORE', lk, '-inf', now - b.win_ms, 'LIMIT', 0, LOG_PRUNE_MAX)
    if #gone > 0 then
      for i = 1, #gone do b.used = b.used - log_amount(gone[i]) end
      if b.used < 0 then b.used = 0 end
      redis.call('ZREMRANGEBYRANK', lk, 0, #gone - 1)
      redis.call('HSET', bk, 'used', b.used)
      if #gone >= LOG_PRUNE_MAX then b.behind = true end
    end
  end
  -- A credit counts in the window it was given for: for ever without a
  -- window, in its calendar window, or until its end time (rolling).
  local credit = tonumber(f[7]) or 0
  if credit > 0 then
    local cp = tonumber(f[8]) or 0
    local live = b.win == '' or (b.win == 'roll' and now < cp)
    if live or ((b.win == 'day' or b.win == 'month') and cp == b.period) then b.credit = credit end
  end
  -- From here on `limit` is what this window admits; `base` the standing limit.
  b.base = b.limit
  b.limit = b.base + b.credit
  return b
end

-- The budget and every budget above it, job's own first; nil and the missing
-- name if one of them does not exist.
local function budget_chain(K, name, now)
  local chain = {}
  local cur = name
  while cur and #chain < 8 do
    local b = load_budget(K, cur, now)
    if not b then return nil, cur end
    chain[#chain + 1] = b
    cur = b.parent
  end
  return chain
end

-- When a rolling budget will have `need` tokens free (ms), or -1 if never by
-- expiry alone. Reads at most 1000 charges: if those are not enough, the time
-- the 1000th leaves is returned, and the question is asked again then.
local function roll_free_at(K, b, need)
  local short = need - (b.limit - b.used)
  if short <= 0 then return 0 end
  local log = redis.call('ZRANGE', K.logp .. b.name, 0, 999, 'WITHSCORES')
  local freed = 0
  for i = 1, #log, 2 do
    freed = freed + log_amount(log[i])
    if freed >= short then return tonumber(log[i + 1]) + b.win_ms end
  end
  if #log >= 2000 then return tonumber(log[#log]) + b.win_ms end
  return -1
end

-- When a budget that refused `need` tokens may admit them: the next calendar
-- window, the rolling window's expiry, or never by itself (-1: only a top-up helps).
local function budget_retry_at(K, b, need, now)
  if need > b.limit then return -1 end
  if b.win == 'day' or b.win == 'month' then
    local _, next_start = period_of(b.win, now)
    return next_start
  elseif b.win == 'roll' then
    return roll_free_at(K, b, need)
  end
  return -1
end

-- The first level of `levels` that cannot admit `amount` more tokens, or nil. A
-- level that is full (or past its limit) admits nothing, not even 0 tokens.
local function refusing_level(levels, amount)
  for i = 1, #levels do
    local b = levels[i]
    if b.used + amount > b.limit or b.used >= b.limit then return b end
  end
  return nil
end

-- Charges `amount` to every level under reservation id `rid` (levels must admit it).
local function reserve(K, rid, job_id, levels, amount, now)
  local names, periods = {}, {}
  for i = 1, #levels do
    local b = levels[i]
    b.used = b.used + amount
    redis.call('HSET', b.key, 'used', b.used)
    redis.call('HINCRBY', b.key, 'accepted', 1)
    if b.win == 'roll' then redis.call('ZADD', K.logp .. b.name, now, amount .. ' ' .. rid) end
    names[i] = b.name
    periods[i] = b.period or 0
  end
  redis.call('HSET', K.resvp .. rid, 'amt', amount, 'est', amount, 'b', table.concat(names, ' '),
             'p', table.concat(periods, ' '), 'state', 'held', 'at', now, 'job', job_id)
end

local function split_words(s)
  local out = {}
  for w in string.gmatch(s or '', '%S+') do out[#out + 1] = w end
  return out
end

-- Whether reservation `rid` (charging `amt`) still counts in budget `b` (the same window).
local function still_counted(K, b, rid, amt, period)
  if b.win == 'day' or b.win == 'month' then return b.period == period end
  if b.win == 'roll' then return redis.call('ZSCORE', K.logp .. b.name, amt .. ' ' .. rid) ~= false end
  return true
end

-- Budget `b` has room again: its parked jobs are due for another try now.
local function room_freed(K, b, now)
  if redis.call('ZSCORE', K.parkedby, b.name) then
    redis.call('ZADD', K.parkedby, now, b.name)
    return true
  end
  return false
end

-- Settles a held reservation: how 'commit' (charge `actual`; a negative
-- actual keeps the amount charged), 'refund' (charge nothing) or 'unknown'
-- (keep the charge: the provider may have been called). What was used is
-- charged in full to every level, past its limit if need be: a budget is the
-- money spent, and a provider bills what it served. A level past its limit
-- admits nothing more until its window or a top-up makes room. Tokens given
-- back make the jobs parked on those budgets due for another try. Returns the
-- state after the call, whether this call changed it, whether tokens were
-- given back to a budget with parked jobs, and the levels this call took past
-- their limits.
local function settle(K, rid, how, actual, now, keep_ms)
  local rk = K.resvp .. rid
  local r = redis.call('HMGET', rk, 'state', 'amt', 'b', 'p')
  if not r[1] then return 'missing', false, false, {} end
  if r[1] ~= 'held' then return r[1], false, false, {} end
  local amt = tonumber(r[2]) or 0
  local target = amt
  if how == 'refund' then target = 0 elseif how == 'commit' and actual >= 0 then target = actual end
  local names, periods = split_words(r[3]), split_words(r[4])
  local levels = {}
  for i = 1, #names do
    local b = load_budget(K, names[i], now)
    -- An unknown outcome is counted on every budget it was charged to, even
    -- one whose window has moved on (the counters are cumulative).
    if b and how == 'unknown' then redis.call('HINCRBY', b.key, 'unknown', 1) end
    if b and how ~= 'refund' and target > 0 then redis.call('HINCRBY', b.key, 'charged', target) end
    if b and still_counted(K, b, rid, amt, tonumber(periods[i]) or 0) then levels[#levels + 1] = b end
  end
  local d = target - amt
  local freed = false
  local crossed = {}
  -- The token-rate windows ('#tpm' and the caps '#tok:<ms>': the names starting with
  -- '#') count what the provider's limiter counted when the call arrived (prompt +
  -- max_tokens, for OpenAI's): usage below the estimate does not give it back,
  -- unless the queue says its provider refunds (control 'tpm_refund').
  local tpm_keeps = how == 'commit' and d < 0 and K.control ~= nil
                    and redis.call('HGET', K.control, 'tpm_refund') ~= '1'
  for i = 1, #levels do
    local b = levels[i]
    local rate_window = string.sub(b.name, 1, 1) == '#'
    if not (tpm_keeps and rate_window) then
      local was = b.used
      b.used = math.max(b.used + d, 0)
      redis.call('HSET', b.key, 'used', b.used)
      if b.win == 'roll' and d ~= 0 then
        local lk = K.logp .. b.name
        local at = redis.call('ZSCORE', lk, amt .. ' ' .. rid)
        redis.call('ZREM', lk, amt .. ' ' .. rid)
        redis.call('ZADD', lk, at, (amt + d) .. ' ' .. rid)
      end
      if d > 0 and not rate_window then
        redis.call('HINCRBY', b.key, 'beyond', d)
        if was <= b.limit and b.used > b.limit then crossed[#crossed + 1] = b end
      end
      if d < 0 and room_freed(K, b, now) then freed = true end
    end
  end
  if d > 0 then redis.call('HSET', rk, 'beyond', d) end
  local state = 'committed'
  if how == 'refund' then state = 'refunded' elseif how == 'unknown' then state = 'unknown' end
  redis.call('HSET', rk, 'state', state, 'amt', target, 'settled', now)
  -- Kept long enough to answer a late commit or refund: a caller's for 8 days
  -- (longer than any rolling window), a job attempt's as long as its job's
  -- record (`keep_ms`), so finished jobs do not leave reservations behind.
  if keep_ms and keep_ms > 0 then
    redis.call('PEXPIRE', rk, math.min(keep_ms, 8 * 86400000))
  else
    redis.call('PEXPIRE', rk, 8 * 86400000)
  end
  return state, true, freed, crossed
end

-- Attempts whose spend a job record lists (the older ones are summed in 'spent' only).
local SPEND_KEEP = 20

-- Records on job record `jk` what attempt reservation `rid` charged once it is
-- settled: 'spend' lists the last SPEND_KEEP attempts as JSON
-- [reservation, estimate, reported usage (-1: none), charged, outcome], and
-- 'spent' sums the charges of every attempt. A list that does not parse
-- (written by hand) starts again rather than fail the call.
local function record_spend(K, jk, rid, outcome, usage)
  local r = redis.call('HMGET', K.resvp .. rid, 'est', 'amt')
  local amt = tonumber(r[2]) or 0
  local f = redis.call('HMGET', jk, 'spend', 'spent')
  local list = {}
  if f[1] then
    local ok, v = pcall(cjson.decode, f[1])
    if ok and type(v) == 'table' then list = v end
  end
  list[#list + 1] = {rid, tonumber(r[1]) or 0, usage, amt, outcome}
  while #list > SPEND_KEEP do table.remove(list, 1) end
  redis.call('HSET', jk, 'spend', cjson.encode(list), 'spent', (tonumber(f[2]) or 0) + amt)
end

-- Callers' holds whose time ran out (their caller crashed, or forgot them),
-- at most `max`, oldest first, settled as unknown outcomes: the charge stays
-- (the provider may have been called) and each budget counts it. Returns
-- their ids, the state each is in after the call, and whether this call
-- settled it. K.held: the index of callers' held reservations.
local function sweep_expired(K, now, max)
  local due = redis.call('ZRANGEBYSCORE', K.held, '-inf', now, 'LIMIT', 0, max)
  local states, changed = {}, {}
  for i = 1, #due do
    states[i], changed[i] = settle(K, due[i], 'unknown', -1, now)
    redis.call('ZREM', K.held, due[i])
  end
  return due, states, changed
end

-- One 'overspent' event per level a settle took past its limit (job_id: the job
-- whose attempt used the tokens, '' for a caller's reservation).
local function emit_overspent(K, crossed, job_id, rid)
  for i = 1, #crossed do
    local b = crossed[i]
    emit(K.events, K.maxlen, 'overspent', job_id, 'budget', b.name, 'used', b.used, 'limit', b.limit,
         'reservation', rid)
  end
end
