-- budget_put: create a budget, change its standing limit, or credit its current window.
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[8] waiting   KEYS[9] wake   KEYS[10] job key prefix   KEYS[11] events
-- KEYS[12] prefix of operation records (budget operation id -> what it did)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] budget name
-- ARGV[3] op: 'create' | 'limit' (set the standing limit) | 'adjust' (add ARGV[4],
--   which may be negative, to the standing limit) | 'credit' (a one-off credit to
--   the current window)
-- ARGV[4] tokens (the limit; the change for 'adjust'; the credit for 'credit')
-- ARGV[5] window: '' | 'day' | 'month' | 'roll'   ARGV[6] rolling window (ms)
-- ARGV[7] parent budget name ('' = none)   ARGV[8] events stream max length
-- ARGV[9] the largest limit allowed
-- ARGV[10] operation id ('' = none; not for 'create'): an operation applies once
--   under its id; the same id again answers what the first call did
-- ARGV[11] how long an operation id is remembered (ms)
--
-- Returns {code, limit, credit} (the standing limit and the current window's
-- credit after the call): 1 done; 2 this operation id was applied before (the
-- values are what that call left, nothing changed now); 0 'create' of a budget
-- that exists (left as it was); -1 no such budget; -2 the parent does not
-- exist; -3 the hierarchy would be deeper than 8 levels; -4 the limit or the
-- limit and credit would pass the largest allowed; -5 the limit would fall
-- below 0; -6 the operation id was used for another operation (then the
-- fourth and fifth values name its op and budget). Nothing changes on an error.
-- A credit is what the current window admits beyond the standing limit: the
-- next calendar window starts without it, a rolling budget's credit ends one
-- window length after it was given (another credit adds to it and starts
-- that length again), and without a window it never ends. Raising what a
-- window admits makes the jobs parked on the budget due for another try.

-- @include clock
-- @include emit
-- @include wake
-- @include ledger

local K = with_flow_keys({waiting = KEYS[8], jobp = KEYS[10], events = KEYS[11], maxlen = ARGV[8]}, 1)
local now, name, op, tokens = clock_ms(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local bk = K.budp .. name
if op == 'create' then
  if redis.call('EXISTS', bk) == 1 then
    return {0, tonumber(redis.call('HGET', bk, 'limit')) or 0, 0}
  end
  local parent = ARGV[7]
  if parent ~= '' then
    local chain = budget_chain(K, parent, now)
    if not chain then return {-2, 0, 0} end
    if #chain >= 8 then return {-3, 0, 0} end
  end
  local period = 0
  if ARGV[5] == 'day' or ARGV[5] == 'month' then period = period_of(ARGV[5], now) end
  redis.call('HSET', bk, 'limit', tokens, 'used', 0, 'win', ARGV[5], 'win_ms', tonumber(ARGV[6]) or 0,
             'period', period, 'created', now, 'accepted', 0, 'rejected', 0, 'unknown', 0)
  if parent ~= '' then redis.call('HSET', bk, 'parent', parent) end
  return {1, tokens, 0}
end
local opk = nil
if ARGV[10] ~= '' then
  opk = KEYS[12] .. ARGV[10]
  local prior = redis.call('HMGET', opk, 'op', 'budget', 'tokens', 'limit', 'credit')
  if prior[1] then
    if prior[1] ~= op or prior[2] ~= name or tonumber(prior[3]) ~= tokens then
      return {-6, 0, 0, prior[1], prior[2]}
    end
    return {2, tonumber(prior[4]) or 0, tonumber(prior[5]) or 0}
  end
end
local b = load_budget(K, name, now)
if not b then return {-1, 0, 0} end
local max = tonumber(ARGV[9])
local base, credit = b.base, b.credit
if op == 'limit' then
  base = tokens
elseif op == 'adjust' then
  base = b.base + tokens
else
  credit = b.credit + tokens
end
if base < 0 then return {-5, b.base, b.credit} end
if base > max or base + credit > max then return {-4, b.base, b.credit} end
redis.call('HSET', bk, 'limit', base, 'credit', credit)
if op == 'credit' then
  local cp = 0
  if b.win == 'day' or b.win == 'month' then cp = b.period elseif b.win == 'roll' then cp = now + b.win_ms end
  redis.call('HSET', bk, 'credit_p', cp)
end
if opk then
  redis.call('HSET', opk, 'op', op, 'budget', name, 'tokens', tokens, 'limit', base, 'credit', credit,
             'at', now)
  redis.call('PEXPIRE', opk, tonumber(ARGV[11]))
end
-- A raised limit makes the parked jobs due: the next dispatch moves back
-- those the room admits, a bounded number per call.
if base + credit > b.limit and room_freed(K, b, now) then redis.call('ZADD', KEYS[9], 0, 'w') end
return {1, base, credit}
