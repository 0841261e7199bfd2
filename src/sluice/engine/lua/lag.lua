-- lag: a worker reports how late its calls leave after their dispatch, and
-- the queue's measured headroom (control 'lag_h') becomes the spread of
-- those delays over every worker that reported lately: the highest delay
-- less the lowest (docs/architecture.md, "The pacer").
--
-- KEYS[1] control   KEYS[2] lags (hash: worker id -> 'lowest highest expires')
-- KEYS[3] the '#tpm' budget   KEYS[4] budget key prefix (the token caps' budgets,
--   '#tok:<ms>' for each ms in control 'tok_caps')
-- ARGV[1] now (ms, '' = Redis's clock)  ARGV[2] worker id
-- ARGV[3] its lowest delay (ms)  ARGV[4] its highest (ms)  ARGV[5] how long the report holds (ms)
-- ARGV[6] 1 to withdraw the worker's report instead (it is leaving)
--
-- The spread is taken over at most LAGS_MAX reports (bounded work); with more
-- workers than that, a report only ever raises the headroom until the
-- others expire. A change of the headroom the token-rate windows count over
-- (the larger of 'headroom_ms' and 'lag_h') rewrites their lengths (at most
-- three: '#tpm' and its caps), as pace.lua does. Returns the measured headroom (ms).

-- @include clock

local LAGS_MAX = 256
local LAG_MAX_MS = 500   -- what the measured headroom may reach: past it, a 429 says more
local HEADROOM_MS = 5    -- the headroom unless set (the default: dispatch.lua)
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
  lo, hi = tonumber(ARGV[3]), tonumber(ARGV[4])
end
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
  if f[3] == '1' and f[4] and math.max(floor, h) ~= math.max(floor, was) then
    redis.call('HSET', KEYS[3], 'win_ms', tonumber(f[4]) + math.max(floor, h))
    local caps = 0
    for ms in string.gmatch(f[5] or '', '%d+') do
      caps = caps + 1
      if caps > WINDOWS_MAX - 1 then break end
      redis.call('HSET', KEYS[4] .. '#tok:' .. ms, 'win_ms', tonumber(ms) + math.max(floor, h))
    end
  end
end
return h
