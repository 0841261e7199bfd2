-- latency: add a worker's latency bin counts to a 10 s and a 1 min bucket hash,
-- and to the metric's cumulative hash.
--
-- KEYS[1] the 10 s bucket hash   KEYS[2] the 1 min bucket hash that contains it
--   (<prefix>:{q}:lat:<metric>:10s:<n> and ...:1m:<m>: the queue's slot)
-- KEYS[3] (optional) the cumulative hash <prefix>:{q}:lat:<metric>:all, never
--   expiring: the Prometheus histograms (service/metrics.py). Its fields are
--   the bins ever used: about 115 per decade of durations, so it stays small.
-- ARGV[1] how long the 10 s bucket lives after this write (ms)
-- ARGV[2] how long the 1 min bucket lives after this write (ms)
-- ARGV[3 ...] pairs: bin (a DDSketch key, or 'z' for 0 ms), count
--
-- Bounded work: at most MAX_PAIRS pairs per call (the caller sends more in
-- further calls, see engine/sketch.py); a longer call is refused whole.
-- Returns the number of pairs added.

local MAX_PAIRS = 256
local pairs_n = (#ARGV - 2) / 2
if pairs_n > MAX_PAIRS or pairs_n ~= math.floor(pairs_n) then
  return redis.error_reply('ERR latency: at most ' .. MAX_PAIRS .. ' (bin, count) pairs per call')
end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  if KEYS[3] then redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1]) end
end
if pairs_n > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return pairs_n
