-- lag: a worker reports how late its calls leave after their dispatch, and
-- the queue's measured headroom (control 'lag_h') becomes the spread of
-- those delays over every worker that reported lately: the highest delay
-- less the lowest (docs/architecture.md, "The pacer").
--
-- KEYS[1] control   KEYS[2] lags (hash: worker id -> 'lowest highest expires')
-- KEYS[3] budget key prefix  KEYS[4] budget log key prefix: the token-rate
--   window '#tpm' and its caps, '#tok:<ms>' for each ms in control 'tok_caps'
-- ARGV[1] now (ms, '' = Redis's clock)  ARGV[2] worker id
-- ARGV[3] its lowest delay (ms)  ARGV[4] its highest (ms)  ARGV[5] how long the report holds (ms)
-- ARGV[6] 1 to withdraw the worker's report instead (it is leaving)
--
-- The spread is taken over at most LAGS_MAX reports (bounded work); with more
-- workers than that, a report only ever raises the headroom, and a random
-- LAGS_MAX of the reports are looked at for expired ones, until there are few
-- enough to read again. A change of the headroom the token-rate windows count over
-- (the larger of 'headroom_ms' and 'lag_h') rewrites their lengths (at most
-- three: '#tpm' and its caps), as pace.lua does. A window that grows by d ms
-- would count again the charges it dropped in its last d ms, which are gone
-- from its log: in their place it is charged their likely sum, 'used' x d /
-- its old length, as one charge 'n g:<now>:<worker>' that leaves it d / 2 ms from now
-- (measured: without it the token window admitted a call or two too early
-- each time the headroom grew, and the provider refused them). Returns the
-- measured headroom (ms).

-- @include clock

local LAGS_MAX = 256
local LAG_MAX_MS = 500   -- what the measured headroom may reach: past it, a 429 says more
local HEADROOM_MS = 10   -- the headroom unless set (the default: dispatch.lua)
local WINDOWS_MAX = 3    -- token windows at most: '#tpm' and two caps (pace.lua's)

local now = clock_ms(ARGV[1])
local control, lags = KEYS[1], KEYS[2]
if ARGV[6] == '1' then
  redis.call('HDEL', lags, ARGV[2])
else
  redis.call('HSET', lags, ARGV[2], ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. (now + tonumber(ARGV[5])))
end
local lo, hi = nil, nil
if redis.call('HLEN', lags) <= LAGS_MAX then
  local all = redis.call('HGETALL', lags)
  for i = 1, #all, 2 do
    local a, b, exp = string.match(all[i + 1], '^(%S+) (%S+) (%S+)$')
    a, b, exp = tonumber(a), tonumber(b), tonumber(exp)
    if not exp or exp < now then
      redis.call('HDEL', lags, all[i])
    else
      if lo == nil or a < lo then lo = a end
      if hi == nil or b > hi then hi = b end
    end
  end
else
  -- Too many to read: a bounded sample of them is looked at, and those that
  -- expired go, so that crashed workers' reports cannot keep it this size.
  local some = redis.call('HRANDFIELD', lags, LAGS_MAX, 'WITHVALUES')
  for i = 1, #some, 2 do
    local exp = tonumber(string.match(some[i + 1], ' (%S+)$'))
    if not exp or exp < now then redis.call('HDEL', lags, some[i]) end
  end
  lo, hi = tonumber(ARGV[3]), tonumber(ARGV[4])
end
-- A queue whose workers all stopped keeps no reports.
if ARGV[6] ~= '1' then redis.call('PEXPIRE', lags, 2 * tonumber(ARGV[5]) + 1000) end
local h = 0
if lo and hi then h = math.min(math.max(math.ceil(hi - lo), 0), LAG_MAX_MS) end
if lo and hi and redis.call('HLEN', lags) > LAGS_MAX then
  h = math.max(h, tonumber(redis.call('HGET', control, 'lag_h')) or 0)
end
local f = redis.call('HMGET', control, 'lag_h', 'headroom_ms', 'tpm', 'tpm_ms', 'tok_caps')
local was = tonumber(f[1]) or 0
if h ~= was then
  if h == 0 then redis.call('HDEL', control, 'lag_h') else redis.call('HSET', control, 'lag_h', h) end
  local floor = tonumber(f[2]) or HEADROOM_MS
  local grow = math.max(floor, h) - math.max(floor, was)
  if f[3] == '1' and f[4] and grow ~= 0 then
    local function rewindow(name, nominal)
      local bk, lk = KEYS[3] .. name, KEYS[4] .. name
      local b = redis.call('HMGET', bk, 'used', 'win_ms')
      local used, win = tonumber(b[1]) or 0, tonumber(b[2]) or 0
      redis.call('HSET', bk, 'win_ms', nominal + math.max(floor, h))
      if grow > 0 and win > 0 and used > 0 then
        local dropped = math.ceil(used * grow / win)
        redis.call('ZADD', lk, now - win - math.floor(grow / 2), dropped .. ' g:' .. now .. ':' .. ARGV[2])
        redis.call('HSET', bk, 'used', used + dropped)
      end
    end
    rewindow('#tpm', tonumber(f[4]))
    local caps = 0
    for ms in string.gmatch(f[5] or '', '%d+') do
      caps = caps + 1
      if caps > WINDOWS_MAX - 1 then break end
      rewindow('#tok:' .. ms, tonumber(ms))
    end
  end
end
return h
