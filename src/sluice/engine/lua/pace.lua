-- pace: sets the token-rate limit or the pacer's settings, in one script so
-- that the token-rate window ('#tpm', a rolling budget) always counts over
-- W + h: its stored window is the nominal one (control 'tpm_ms') plus the
-- headroom, the larger of the least set (control 'headroom_ms') and the
-- measured one (control 'lag_h', see lag.lua), whichever changes. A change
-- forgets the pacer's times it affects (a start is due at once; the logs
-- still cap), and wakes idle workers.
--
-- KEYS[1] control   KEYS[2] the '#tpm' budget   KEYS[3] wake
-- ARGV[1] 'tokens': ARGV[2] the limit ('' removes it), ARGV[3] its window (ms),
--   ARGV[4] '1' if the provider gives back what a call did not use (control 'tpm_refund')
-- ARGV[1] 'pacing': ARGV[2] tolerance (ms, or 'off'), ARGV[3] headroom (ms)

local control, tpm = KEYS[1], KEYS[2]
local lag = tonumber(redis.call('HGET', control, 'lag_h')) or 0
if ARGV[1] == 'tokens' then
  if ARGV[2] == '' then
    redis.call('HDEL', control, 'tpm', 'tpm_ms', 'tat_tok', 'tpm_refund')
  else
    local h = tonumber(redis.call('HGET', control, 'headroom_ms')) or 20 -- (the default: dispatch.lua)
    redis.call('HSET', tpm, 'limit', ARGV[2], 'win', 'roll', 'win_ms', tonumber(ARGV[3]) + math.max(h, lag))
    redis.call('HSETNX', tpm, 'used', 0)
    redis.call('HSET', control, 'tpm', 1, 'tpm_ms', ARGV[3])
    if ARGV[4] == '1' then
      redis.call('HSET', control, 'tpm_refund', 1)
    else
      redis.call('HDEL', control, 'tpm_refund')
    end
    redis.call('HDEL', control, 'tat_tok')
  end
else
  local h = tonumber(ARGV[3])
  redis.call('HSET', control, 'tolerance_ms', ARGV[2], 'headroom_ms', h)
  redis.call('HDEL', control, 'tat_req', 'tat_tok')
  if redis.call('HGET', control, 'tpm') == '1' then
    -- A window set before the headroom existed is its nominal length.
    local w = tonumber(redis.call('HGET', control, 'tpm_ms')) or tonumber(redis.call('HGET', tpm, 'win_ms'))
    if w then
      redis.call('HSET', tpm, 'win_ms', w + math.max(h, lag))
      redis.call('HSET', control, 'tpm_ms', w)
    end
  end
end
redis.call('ZADD', KEYS[3], 0, 'w')
return 1
