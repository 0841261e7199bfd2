-- observe: what providers' answers said of their limits, compared with the
-- queue's own windows (engine/provider_view.py; docs/architecture.md, "The
-- provider's view").
--
-- KEYS[1 .. 7] flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- ARGV[1] now (ms, '' = Redis's clock)
-- then per report, eight values: when the attempt was dispatched (ms, Redis's
-- clock), the provider's request limit, requests remaining, token limit,
-- tokens remaining ('' for what the answer did not say), the attempt's
-- '<job id>:<token>', its token estimate, and how late it reached the provider
-- (ms, beyond the quickest of its worker's calls). At most 32 reports.
--
-- A limit stated in a header says nothing of its window. It is taken for the
-- queue's request window with the same limit (its user copied the provider's
-- page); with none of that limit, remaining requests are not compared (the
-- first version compared them with the shortest window whatever the header's,
-- and a queue of 10 a second under a provider's 500 a minute stalled on
-- invented use).
-- For each report, when the queue has such a window:
-- * requests: the provider's use when the call arrived is limit - remaining;
--   the queue's is its request log around the dispatch, counted over W + h
--   before it and h after (more than the provider's W: calls started up to h
--   later may have overtaken this one, and calls that it overtook are counted
--   by the queue and not yet by the provider, so the difference errs low). The
--   log keeps its starts a paced window and 500 ms past its own, and the
--   longest cap (dispatch.lua), so an answer that comes back within a window of
--   its dispatch is compared. What the provider counted beyond the queue is use
--   the queue did not see (another program on the key, a count of its own): it
--   goes into the log at the dispatch time as starts 'x:<time>:<n>' and leaves
--   it when the window turns. At most UNSEEN_MAX per report (one ZADD: bounded
--   work).
-- * a limit lower than the queue's lowers the queue's (control 'rate_max', the
--   '#tpm' budget's 'limit') when the queue has a single window of that kind;
--   one that is higher changes nothing (the queue may be meant to use part of a
--   key).
-- Tokens remaining are not compared: the token window (a rolling budget) drops
-- its charges as they leave it, so by the time an answer comes back it no
-- longer holds what it held at the dispatch, and the difference would count
-- the charges that left as use nobody saw (measured: 200,000 phantom tokens
-- in a 10-second run).
-- * late calls stay longer: a call that reached the provider d ms later than
--   the quickest holds its place in the provider's window d ms longer than
--   the queue's windows count it, so its start in the request log and its
--   charge in the token window's log are moved d ms later (never earlier),
--   if they are still there. That is what lets the headroom be small: it need
--   not cover the slowest calls, only what the estimate of d misses.
-- Nothing is done when control 'follow' is '0'.
-- Returns {requests added, limits lowered, entries moved}.

-- @include clock
-- @include ledger

local UNSEEN_MAX = 100
local LATE_MAX_MS = 500  -- what a call is taken to be late at most (lag.lua's bound)
local KEEP_MS = 500  -- the log keeps starts W + KEEP_MS past its window (dispatch.lua)
local K = with_flow_keys({}, 1)
local now = clock_ms(ARGV[1])
local c = redis.call('HMGET', K.control, 'follow', 'rate_max', 'rate_ms', 'tpm', 'tpm_ms', 'headroom_ms',
                     'lag_h', 'unseen_seq', 'rate_caps', 'tok_caps')
if c[1] == '0' then return {0, 0, 0} end
local h = math.max(tonumber(c[6]) or 10, tonumber(c[7]) or 0)
-- The request windows, {limit, ms}: the paced one and its caps (at most 3, dispatch.lua's)
local windows = {}
if tonumber(c[2]) then windows[1] = {tonumber(c[2]), tonumber(c[3]) or 0} end
for ms, n in string.gmatch(c[9] or '', '(%d+):(%d+)') do
  if #windows < 3 then windows[#windows + 1] = {tonumber(n), tonumber(ms)} end
end
-- A limit stated in a header says nothing of its window: it is taken for the queue's window
-- of the same limit (the user copied the provider's page), and only lowers a kind that has
-- a single window (with several, which one it means cannot be told).
local function window_of(limit)
  for j = 1, #windows do
    if windows[j][1] == limit then return windows[j] end
  end
  return nil
end
local single_tokens = (c[10] or '') == ''
local rate_max, rate_ms = tonumber(c[2]), tonumber(c[3])
local tpm = nil
if c[4] == '1' then tpm = load_budget(K, '#tpm', now) end
local seq = tonumber(c[8]) or 0
local added_req, lowered, moved = 0, 0, 0

-- Moves `member` of zset `key` to `at` if it is there and earlier.
local function later(key, member, at)
  local was = redis.call('ZSCORE', key, member)
  if was and tonumber(was) < at then
    redis.call('ZADD', key, 'XX', at, member)
    moved = moved + 1
  end
end

for i = 2, #ARGV - 7, 8 do
  local at = tonumber(ARGV[i])
  local lim_r, rem_r = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local lim_t = tonumber(ARGV[i + 3])
  if at and rate_max and lim_r then
    if lim_r >= 1 and lim_r < rate_max and #windows == 1 then
      rate_max = lim_r
      windows[1][1] = lim_r
      redis.call('HSET', K.control, 'rate_max', lim_r)
      lowered = lowered + 1
    end
    local w = window_of(lim_r)
    -- (the log keeps a paced window more than it counts, and the longest cap)
    if w and rem_r and at > now - math.max(rate_ms, w[2]) - KEEP_MS then
      local ours = redis.call('ZCOUNT', K.starts, '(' .. (at - w[2] - h), at + h)
      local unseen = math.min(lim_r - rem_r - ours, w[1], UNSEEN_MAX)
      if unseen > 0 then
        local a = {}
        for n = 1, unseen do
          seq = seq + 1
          a[#a + 1] = at
          a[#a + 1] = 'x:' .. at .. ':' .. seq
        end
        redis.call('ZADD', K.starts, unpack(a))
        added_req = added_req + unseen
      end
    end
  end
  if at and tpm and lim_t then
    if lim_t >= 1 and lim_t < tpm.base and single_tokens then
      tpm.base, tpm.limit = lim_t, lim_t + tpm.credit
      redis.call('HSET', tpm.key, 'limit', lim_t)
      lowered = lowered + 1
    end
  end
  local member, est, late = ARGV[i + 5], tonumber(ARGV[i + 6]) or 0, tonumber(ARGV[i + 7]) or 0
  if at and member ~= '' and late >= 1 then
    late = math.min(math.floor(late), LATE_MAX_MS)
    if rate_max then later(K.starts, member, at + late) end
    if tpm and est > 0 then
      -- the charge is '<estimate> <rid>', or '<usage> <rid>' once a usage above it was settled
      local lk = K.logp .. '#tpm'
      local charge = est .. ' ' .. member
      if not redis.call('ZSCORE', lk, charge) then
        charge = (redis.call('HGET', K.resvp .. member, 'amt') or '') .. ' ' .. member
      end
      later(lk, charge, at + late)
    end
  end
end
if seq ~= (tonumber(c[8]) or 0) then redis.call('HSET', K.control, 'unseen_seq', seq) end
if added_req > 0 then redis.call('HINCRBY', K.control, 'unseen_requests', added_req) end
return {added_req, lowered, moved}
