-- budget_read: budgets as they stand now (windows moved on first).
--
-- KEYS[1 .. 7]  flow-control and ledger keys (see includes/ledger.lua: with_flow_keys)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)  ARGV[1 + i] name of the i-th budget
--
-- Returns per budget a flat list of 14 values (all false if it does not exist):
-- the standing limit, used, window, window ms, period, parent, accepted,
-- rejected, unknown, parked jobs, when its window next turns or frees tokens
-- (ms, -1 never), tokens charged beyond estimates (cumulative), the
-- current window's one-off credit (it admits limit + credit), and the tokens
-- of every settled reservation (cumulative: the burn rate is its rate).

-- @include clock
-- @include ledger

local K = with_flow_keys({}, 1)
local now = clock_ms(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local b = load_budget(K, ARGV[i], now)
  if not b then
    for _ = 1, 14 do out[#out + 1] = false end
  else
    local c = redis.call('HMGET', b.key, 'accepted', 'rejected', 'unknown', 'beyond', 'charged')
    local turns = -1
    if b.win == 'day' or b.win == 'month' then
      local _, nxt = period_of(b.win, now)
      turns = nxt
    elseif b.win == 'roll' then
      local first = redis.call('ZRANGE', K.logp .. b.name, 0, 0, 'WITHSCORES')
      if #first > 0 then turns = tonumber(first[2]) + b.win_ms end
    end
    local vals = {b.base, b.used, b.win, b.win_ms, b.period, b.parent or '', tonumber(c[1]) or 0,
                  tonumber(c[2]) or 0, tonumber(c[3]) or 0, redis.call('ZCARD', K.parkp .. b.name), turns,
                  tonumber(c[4]) or 0, b.credit, tonumber(c[5]) or 0}
    for j = 1, 14 do out[#out + 1] = vals[j] end
  end
end
return out
