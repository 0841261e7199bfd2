-- observe: what providers' answers said of their limits, compared with the
-- queue's own windows (engine/provider_view.py; docs/architecture.md, "The
-- provider's view").
--
-- KEYS[1 .. 7] flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- ARGV[1] now (ms, '' = Redis's clock)
-- then per report, five values: when the attempt was dispatched (ms, Redis's
-- clock), the provider's request limit, requests remaining, token limit,
-- tokens remaining ('' for what the answer did not say). At most 32 reports.
--
-- For each report, per kind (requests; tokens), when the queue has that limit:
-- * the provider's use when the call arrived is limit - remaining; the queue's
--   is its window at the dispatch, counted over W + h before it and h after
--   (more than the provider's W: calls started up to h later may have
--   overtaken this one, and calls that it overtook are counted by the queue and
--   not yet by the provider, so the difference errs low). What the provider
--   counted beyond the queue is use the queue did not see (another program on
--   the key, a count of its own): it goes into the window at the dispatch
--   time, as starts 'x:<time>:<n>' or a charge '<n> x:<time>:<n>' in the
--   '#tpm' log, and leaves it when the window turns. At most UNSEEN_MAX
--   starts per report (one ZADD of them: bounded work), the token limit's worth
--   of tokens.
-- * a limit lower than the queue's lowers the queue's (control 'rate_max', the
--   '#tpm' budget's 'limit'); one that is higher changes nothing (the queue may
--   be meant to use part of a key).
-- Nothing is done when control 'follow' is '0'. The token window's charges in
-- (dispatch - W - h, dispatch + h] are summed from its log, at most TOKEN_LOG_MAX
-- of them: past that the tokens are not compared (the limit still is).
-- Returns {requests added, tokens added, limits lowered}.

-- @include clock
-- @include ledger

local TOKEN_LOG_MAX = 2000
local UNSEEN_MAX = 100
local K = with_flow_keys({}, 1)
local now = clock_ms(ARGV[1])
local c = redis.call('HMGET', K.control, 'follow', 'rate_max', 'rate_ms', 'tpm', 'tpm_ms', 'headroom_ms',
                     'lag_h', 'unseen_seq')
if c[1] == '0' then return {0, 0, 0} end
local h = math.max(tonumber(c[6]) or 5, tonumber(c[7]) or 0)
local rate_max, rate_ms = tonumber(c[2]), tonumber(c[3])
local tpm = nil
if c[4] == '1' then tpm = load_budget(K, '#tpm', now) end
local seq = tonumber(c[8]) or 0
local added_req, added_tok, lowered = 0, 0, 0

for i = 2, #ARGV - 4, 5 do
  local at = tonumber(ARGV[i])
  local lim_r, rem_r = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local lim_t, rem_t = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  if at and rate_max and lim_r then
    if lim_r >= 1 and lim_r < rate_max then
      rate_max = lim_r
      redis.call('HSET', K.control, 'rate_max', lim_r)
      lowered = lowered + 1
    end
    if rem_r and at > now - rate_ms - h then
      local ours = redis.call('ZCOUNT', K.starts, '(' .. (at - rate_ms - h), at + h)
      local unseen = math.min(lim_r - rem_r - ours, rate_max, UNSEEN_MAX)
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
    if lim_t >= 1 and lim_t < tpm.base then
      tpm.base, tpm.limit = lim_t, lim_t + tpm.credit
      redis.call('HSET', tpm.key, 'limit', lim_t)
      lowered = lowered + 1
    end
    if rem_t and at > now - tpm.win_ms then
      local log = redis.call('ZRANGEBYSCORE', K.logp .. '#tpm', '(' .. (at - tpm.win_ms), at + h, 'LIMIT', 0,
                             TOKEN_LOG_MAX + 1)
      if #log <= TOKEN_LOG_MAX then
        local ours = 0
        for j = 1, #log do ours = ours + log_amount(log[j]) end
        local unseen = math.min(lim_t - rem_t - ours, tpm.limit)
        if unseen > 0 then
          seq = seq + 1
          redis.call('ZADD', K.logp .. '#tpm', at, unseen .. ' x:' .. at .. ':' .. seq)
          tpm.used = tpm.used + unseen
          redis.call('HSET', tpm.key, 'used', tpm.used)
          added_tok = added_tok + unseen
        end
      end
    end
  end
end
if seq ~= (tonumber(c[8]) or 0) then redis.call('HSET', K.control, 'unseen_seq', seq) end
if added_req > 0 then redis.call('HINCRBY', K.control, 'unseen_requests', added_req) end
if added_tok > 0 then redis.call('HINCRBY', K.control, 'unseen_tokens', added_tok) end
return {added_req, added_tok, lowered}
