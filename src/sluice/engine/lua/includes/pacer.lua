-- The pacers' arithmetic, shared by dispatch.lua's gates and finish.lua's
-- throttle (docs/architecture.md, "The pacer").
--
-- pace_wait(G, tat) -> 0 if a start is due now, else the first ms it is.
-- pace_next(G, tat, cost, win_ms, limit) -> the theoretical arrival time
--   after a start of `cost` units.
-- slow_now(pm, at, recover_ms, now) -> the slowing factor now (per mille).
-- slow_recover_ms(rate_ms, tpm_ms) -> how long a slowing takes to wear off.
-- slow_down(K, now): a provider refused a call (a 429): the pacers slow down.
-- G is load_gates' table (includes/dispatch.lua); K needs control.

-- After repeated 429s the pacers run slower for a while: their rate times a
-- factor in per mille (control 'slow_pm', set at 'slow_at') that climbs back
-- to 1000 over SLOW_RECOVER windows of the longest limit. A first 429 after a
-- quiet spell is taken for an accident of timing (one call that arrived
-- late): it is only remembered. Each further one within the recovery takes
-- SLOW_STEP of what the factor is then, down to SLOW_FLOOR, at most one per
-- SLOW_QUIET_MS: the calls refused in one burst are one mistake, not several.
local SLOW_STEP, SLOW_FLOOR, SLOW_RECOVER, SLOW_QUIET_MS = 950, 500, 2, 250

local function slow_recover_ms(rate_ms, tpm_ms)
  return SLOW_RECOVER * math.max(tonumber(rate_ms) or 0, tonumber(tpm_ms) or 0, 1000)
end

-- The factor now (per mille, an integer): 1000 unless a 429 slowed the pacers lately.
local function slow_now(pm, at, recover_ms, now)
  pm, at = tonumber(pm), tonumber(at)
  if not pm or not at or now - at >= recover_ms then return 1000 end
  return math.floor(pm + (1000 - pm) * math.max(now - at, 0) / recover_ms)
end

-- A provider refused a call (a 429): the pacers slow down (see slow_now).
local function slow_down(K, now)
  local f = redis.call('HMGET', K.control, 'slow_pm', 'slow_at', 'rate_ms', 'tpm_ms')
  local at = tonumber(f[2])
  if at and now - at < SLOW_QUIET_MS and now >= at then return end
  local recover = slow_recover_ms(f[3], f[4])
  if not at or now - at >= recover or now < at then
    redis.call('HSET', K.control, 'slow_pm', 1000, 'slow_at', now)
    return
  end
  local pm = slow_now(f[1], f[2], recover, now)
  redis.call('HSET', K.control, 'slow_pm', math.max(SLOW_FLOOR, math.floor(pm * SLOW_STEP / 1000)),
             'slow_at', now)
end

-- The pacer's answer: 0 if a start is due (tat - tau <= now), else the first
-- ms at which it is.
local function pace_wait(G, tat)
  if not G.pace or tat - G.tau_us <= G.now_us then return 0 end
  return math.ceil((tat - G.tau_us) / 1000)
end

-- The pacer's next theoretical arrival time after a start of `cost` units, each
-- (win_ms / limit) ms apart (slower after a 429: G.slow), in whole microseconds,
-- rounded up.
local function pace_next(G, tat, cost, win_ms, limit)
  if G.slow < 1000 then
    return math.max(tat, G.now_us) + math.ceil(cost * win_ms * 1000 * 1000 / (limit * G.slow))
  end
  return math.max(tat, G.now_us) + math.ceil(cost * win_ms * 1000 / limit)
end
