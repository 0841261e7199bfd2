-- budget_restore: make again a budget that Redis lost, from a copy kept elsewhere (the
-- service's store), with what its window had used.
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] budget name
-- ARGV[3] limit  ARGV[4] window: '' | 'day' | 'month' | 'roll'  ARGV[5] rolling window (ms)
-- ARGV[6] parent ('' = none)  ARGV[7] when the copy was taken (ms)
-- ARGV[8] tokens used as of the copy  ARGV[9] credit as of the copy  ARGV[10] its window
-- (credit_p, as the budget stored it)  ARGV[11] tokens charged since the copy
--
-- Returns 1 made, 0 the budget exists (nothing changes: a live budget is never
-- overwritten), -2 its parent does not exist (restore parents first).
-- What was used counts only while its window lasts: a calendar window that
-- has turned since the copy keeps only the charges since; a rolling window
-- takes all of it as charged now, so it leaves a whole window from now (later
-- than it would have: never too early, which would admit money already spent).
-- The counters (accepted, rejected, ...) start again from 0.

-- @include clock
-- @include ledger

local K = with_flow_keys({}, 1)
local now, name = clock_ms(ARGV[1]), ARGV[2]
local bk = K.budp .. name
if redis.call('EXISTS', bk) == 1 then return 0 end
local parent = ARGV[6]
if parent ~= '' and redis.call('EXISTS', K.budp .. parent) == 0 then return -2 end
local win, win_ms, snap = ARGV[4], tonumber(ARGV[5]) or 0, tonumber(ARGV[7]) or 0
local used = (tonumber(ARGV[8]) or 0) + (tonumber(ARGV[11]) or 0)
local credit, credit_p = tonumber(ARGV[9]) or 0, tonumber(ARGV[10]) or 0
local period = 0
if win == 'day' or win == 'month' then
  period = period_of(win, now)
  if period_of(win, snap) ~= period then
    used = tonumber(ARGV[11]) or 0
  end
  if credit_p ~= period then credit, credit_p = 0, 0 end
elseif win == 'roll' then
  if credit_p <= now then credit, credit_p = 0, 0 end
  if used > 0 then redis.call('ZADD', K.logp .. name, now, used .. ' restore:' .. now) end
end
redis.call('HSET', bk, 'limit', tonumber(ARGV[3]) or 0, 'used', used, 'win', win, 'win_ms', win_ms,
           'period', period, 'created', now, 'restored', now, 'accepted', 0, 'rejected', 0,
           'unknown', 0, 'credit', credit, 'credit_p', credit_p)
if parent ~= '' then redis.call('HSET', bk, 'parent', parent) end
return 1
