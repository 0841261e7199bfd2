-- budget_put: create a budget, change its limit, or top it up.
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[8] waiting   KEYS[9] wake   KEYS[10] job key prefix   KEYS[11] events
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] budget name  ARGV[3] op: 'create' | 'limit' | 'topup'
-- ARGV[4] tokens (the limit; for 'topup' the amount added to it)
-- ARGV[5] window: '' | 'day' | 'month' | 'roll'   ARGV[6] rolling window (ms)
-- ARGV[7] parent budget name ('' = none)   ARGV[8] events stream max length
-- ARGV[9] the largest limit allowed
--
-- Returns {code, limit}: 1 done; 0 'create' of a budget that exists (left as
-- it was); -1 no such budget ('limit', 'topup'); -2 the parent does not
-- exist; -3 the hierarchy would be deeper than 8 levels; -4 a top-up would
-- take the limit past the largest allowed (nothing changed).
-- A raised limit makes the jobs parked on the budget due for another try.

-- @include clock
-- @include emit
-- @include wake
-- @include ledger

local K = with_flow_keys({waiting = KEYS[8], jobp = KEYS[10], events = KEYS[11], maxlen = ARGV[8]}, 1)
local now, name, op, tokens = clock_ms(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local bk = K.budp .. name
if op == 'create' then
  if redis.call('EXISTS', bk) == 1 then
    return {0, tonumber(redis.call('HGET', bk, 'limit')) or 0}
  end
  local parent = ARGV[7]
  if parent ~= '' then
    local chain = budget_chain(K, parent, now)
    if not chain then return {-2, 0} end
    if #chain >= 8 then return {-3, 0} end
  end
  local period = 0
  if ARGV[5] == 'day' or ARGV[5] == 'month' then period = period_of(ARGV[5], now) end
  redis.call('HSET', bk, 'limit', tokens, 'used', 0, 'win', ARGV[5], 'win_ms', tonumber(ARGV[6]) or 0,
             'period', period, 'created', now, 'accepted', 0, 'rejected', 0, 'unknown', 0)
  if parent ~= '' then redis.call('HSET', bk, 'parent', parent) end
  return {1, tokens}
end
local b = load_budget(K, name, now)
if not b then return {-1, 0} end
local limit = tokens
if op == 'topup' then limit = b.limit + tokens end
if limit > tonumber(ARGV[9]) then return {-4, b.limit} end
redis.call('HSET', bk, 'limit', limit)
-- A raised limit makes the parked jobs due: the next dispatch moves back
-- those the room admits, a bounded number per call.
if limit > b.limit and room_freed(K, b, now) then redis.call('ZADD', KEYS[9], 0, 'w') end
return {1, limit}
