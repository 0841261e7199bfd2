-- pace: sets the request-rate or token-rate limits (the windows of one kind)
-- or the pacer's settings, in one script so that every token-rate window (a
-- rolling budget: '#tpm', the paced one, and '#tok:<ms>', the caps) always
-- counts over W + h: its stored window is the nominal one plus the headroom,
-- the larger of the least set (control 'headroom_ms') and the measured one
-- (control 'lag_h', see lag.lua), whichever changes. A change forgets the
-- pacer's times it affects (a start is due at once; the logs still cap), and
-- wakes idle workers.
--
-- The windows of a kind, shortest first: the first is the paced one (requests:
-- control 'rate_max' and 'rate_ms'; tokens: the '#tpm' budget, control 'tpm'
-- and 'tpm_ms'), the others are caps (requests: control 'rate_caps',
-- 'ms:limit ...'; tokens: control 'tok_caps', 'ms ...', each the budget
-- '#tok:<ms>'). A token cap that is removed is deleted (UNLINK: freed in the
-- background however long its log); one that stays keeps what it counts.
--
-- KEYS[1] control   KEYS[2] the '#tpm' budget   KEYS[3] wake
-- KEYS[4] budget key prefix   KEYS[5] rolling-log key prefix (the caps' budgets and logs)
-- ARGV[1] 'requests' or 'tokens': ARGV[2] 'all' (every window of the kind is
--   replaced by those given) or 'first' (the paced one only; the caps stay, and
--   the window given must be shorter, and its limit lower, than each of theirs),
--   ARGV[3] '1' if the provider gives back what a call did not use (tokens:
--   control 'tpm_refund'), ARGV[4 ..] the windows: ms, limit, ms, limit ...,
--   shortest first (checked by the caller); none removes every window of the kind
-- ARGV[1] 'pacing': ARGV[2] tolerance (ms, or 'off'), ARGV[3] headroom (ms)
--
-- Returns {1}, or {0, ms, limit}: a cap that the paced window given ('first')
-- is not shorter or lower than; nothing was changed.

local control, tpm, budp, logp = KEYS[1], KEYS[2], KEYS[4], KEYS[5]
local WINDOWS_MAX = 3 -- per kind (dispatch.lua's; flow.py checks it)

local function headroom()
  local f = redis.call('HMGET', control, 'headroom_ms', 'lag_h')
  return math.max(tonumber(f[1]) or 10, tonumber(f[2]) or 0) -- (10: the default, dispatch.lua)
end

-- The caps of a kind as {ms, limit} pairs (tokens: the limit from the cap's budget).
local function caps_of(kind)
  local out = {}
  if kind == 'requests' then
    for ms, n in string.gmatch(redis.call('HGET', control, 'rate_caps') or '', '(%d+):(%d+)') do
      out[#out + 1] = {tonumber(ms), tonumber(n)}
    end
  else
    for ms in string.gmatch(redis.call('HGET', control, 'tok_caps') or '', '%d+') do
      out[#out + 1] = {tonumber(ms), tonumber(redis.call('HGET', budp .. '#tok:' .. ms, 'limit')) or 0}
    end
  end
  return out
end

local function set_requests(windows)
  if #windows == 0 then
    redis.call('HDEL', control, 'rate_max', 'rate_ms', 'tat_req', 'rate_caps')
    return
  end
  redis.call('HSET', control, 'rate_max', windows[1][2], 'rate_ms', windows[1][1])
  local caps = {}
  for i = 2, #windows do caps[#caps + 1] = windows[i][1] .. ':' .. windows[i][2] end
  if #caps > 0 then
    redis.call('HSET', control, 'rate_caps', table.concat(caps, ' '))
  else
    redis.call('HDEL', control, 'rate_caps')
  end
  redis.call('HDEL', control, 'tat_req')
end

local function set_tokens(windows, refund)
  local kept = {}
  for i = 2, #windows do kept[tostring(windows[i][1])] = true end
  for ms in string.gmatch(redis.call('HGET', control, 'tok_caps') or '', '%d+') do
    if not kept[ms] then redis.call('UNLINK', budp .. '#tok:' .. ms, logp .. '#tok:' .. ms) end
  end
  if #windows == 0 then
    redis.call('HDEL', control, 'tpm', 'tpm_ms', 'tat_tok', 'tpm_refund', 'tok_caps')
    return
  end
  local h = headroom()
  redis.call('HSET', tpm, 'limit', windows[1][2], 'win', 'roll', 'win_ms', windows[1][1] + h)
  redis.call('HSETNX', tpm, 'used', 0)
  redis.call('HSET', control, 'tpm', 1, 'tpm_ms', windows[1][1])
  local caps = {}
  for i = 2, #windows do
    local bk = budp .. '#tok:' .. windows[i][1]
    redis.call('HSET', bk, 'limit', windows[i][2], 'win', 'roll', 'win_ms', windows[i][1] + h)
    redis.call('HSETNX', bk, 'used', 0)
    caps[#caps + 1] = windows[i][1]
  end
  if #caps > 0 then
    redis.call('HSET', control, 'tok_caps', table.concat(caps, ' '))
  else
    redis.call('HDEL', control, 'tok_caps')
  end
  if refund then
    redis.call('HSET', control, 'tpm_refund', 1)
  else
    redis.call('HDEL', control, 'tpm_refund')
  end
  redis.call('HDEL', control, 'tat_tok')
end

if ARGV[1] == 'requests' or ARGV[1] == 'tokens' then
  local windows = {}
  for i = 4, #ARGV, 2 do
    if #windows < WINDOWS_MAX then windows[#windows + 1] = {tonumber(ARGV[i]), tonumber(ARGV[i + 1])} end
  end
  if ARGV[2] == 'first' and #windows > 0 then
    local caps = caps_of(ARGV[1])
    for i = 1, #caps do
      if caps[i][1] <= windows[1][1] or caps[i][2] <= windows[1][2] then return {0, caps[i][1], caps[i][2]} end
      if #windows < WINDOWS_MAX then windows[#windows + 1] = caps[i] end
    end
  end
  if ARGV[1] == 'requests' then set_requests(windows) else set_tokens(windows, ARGV[3] == '1') end
else
  local h = tonumber(ARGV[3])
  redis.call('HSET', control, 'tolerance_ms', ARGV[2], 'headroom_ms', h)
  redis.call('HDEL', control, 'tat_req', 'tat_tok')
  if redis.call('HGET', control, 'tpm') == '1' then
    h = headroom()
    -- A window set before the headroom existed is its nominal length.
    local w = tonumber(redis.call('HGET', control, 'tpm_ms')) or tonumber(redis.call('HGET', tpm, 'win_ms'))
    if w then
      redis.call('HSET', tpm, 'win_ms', w + h)
      redis.call('HSET', control, 'tpm_ms', w)
    end
    for ms in string.gmatch(redis.call('HGET', control, 'tok_caps') or '', '%d+') do
      redis.call('HSET', budp .. '#tok:' .. ms, 'win_ms', tonumber(ms) + h)
    end
  end
end
redis.call('ZADD', KEYS[3], 0, 'w')
return {1}
