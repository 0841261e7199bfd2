-- reserve: charge tokens to a budget and every budget above it, atomically,
-- under a reservation id; for callers that reserve themselves (the dispatch
-- script reserves for jobs added with a budget).
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- KEYS[8] held (callers' held reservations -> when their hold ends)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[2] budget name  ARGV[3] tokens  ARGV[4] reservation id
-- ARGV[5] job id ('' if none)  ARGV[6] how long the reservation may stay held (ms)
--
-- Returns {code, remaining, budget}: 1 reserved; 0 refused (some level cannot
-- admit the tokens; nothing was charged; the third value names it); 2 this
-- reservation id exists already and still charges (held, committed or
-- unknown), 3 it exists and was refunded, 4 it was refused before (the third
-- value names the budget that refused it): nothing is charged again in any of
-- these; -1 no such budget (the third value names the missing one); -5 this id
-- was reserved on another budget (named third).
-- remaining is what the budget named in ARGV[2] has left after the call.
--
-- A refusal is remembered under its id as long as a hold would be: a caller
-- that asks again (a retry after a timeout) gets the same answer, not one
-- that room freed meanwhile would give.
-- Each call first settles a few holds whose time ran out (see sweep_expired),
-- so a ledger used without workers cleans up after crashed callers too.

-- @include clock
-- @include ledger

-- Expired holds settled per reserve call (the worker's sweep takes more).
local SWEEP_ON_RESERVE = 10

local K = with_flow_keys({held = KEYS[8]}, 1)
local now, name, tokens, rid = clock_ms(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4]
sweep_expired(K, now, SWEEP_ON_RESERVE)
local chain, missing = budget_chain(K, name, now)
if not chain then return {-1, 0, missing} end
local own = chain[1]
local prior = redis.call('HMGET', K.resvp .. rid, 'state', 'b', 'by')
if prior[1] then
  local first = split_words(prior[2])[1] or ''
  if first ~= name then return {-5, 0, first} end
  local code = 2
  if prior[1] == 'refunded' then code = 3 elseif prior[1] == 'refused' then code = 4 end
  return {code, math.max(own.limit - own.used, 0), prior[3] or ''}
end
local refusing = refusing_level(chain, tokens)
-- A caller gets a definite answer: a level still counting charges that left
-- its window is caught up first (a few more bounded steps, in this call).
for _ = 1, 4 do
  local behind = false
  for i = 1, #chain do behind = behind or chain[i].behind end
  if not (refusing and behind) then break end
  chain = budget_chain(K, name, now)
  own = chain[1]
  refusing = refusing_level(chain, tokens)
end
if refusing then
  redis.call('HINCRBY', refusing.key, 'rejected', 1)
  local names, periods = {}, {}
  for i = 1, #chain do
    names[i] = chain[i].name
    periods[i] = chain[i].period or 0
  end
  local rk = K.resvp .. rid
  redis.call('HSET', rk, 'amt', 0, 'est', tokens, 'b', table.concat(names, ' '), 'p',
             table.concat(periods, ' '), 'state', 'refused', 'at', now, 'job', ARGV[5], 'by', refusing.name)
  redis.call('PEXPIRE', rk, tonumber(ARGV[6]))
  return {0, math.max(own.limit - own.used, 0), refusing.name}
end
reserve(K, rid, ARGV[5], chain, tokens, now)
-- A hold that is not settled in time (its caller may have crashed) is swept
-- as an unknown outcome: the charge stays, spent as far as anyone can tell.
-- The record outlives the hold, so the sweep finds it; it then stays 8 days.
local deadline = now + tonumber(ARGV[6])
redis.call('ZADD', K.held, deadline, rid)
redis.call('PEXPIRE', K.resvp .. rid, tonumber(ARGV[6]) + 8 * 86400000)
return {1, own.limit - own.used, ''}
