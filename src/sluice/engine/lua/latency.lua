-- latency: add a worker's latency bin counts to a 10 s and a 1 min bucket hash,
-- and to the metric's cumulative hash for the jobs' priority.
--
-- KEYS[1] the 10 s bucket hash   KEYS[2] the 1 min bucket hash that contains it
--   (<prefix>:{q}:lat:<metric>:10s:<n> and ...:1m:<m>: the queue's slot)
-- KEYS[3 .. 5] (optional, together) the cumulative hash of this priority
--   (<prefix>:{q}:lat:<metric>:all:<priority>), the one of every priority past
--   the cap (...:all:other), and the set of priorities that have their own:
--   never expiring, the Prometheus histograms (service/metrics.py). A hash's
--   fields are the bins ever used: about 115 per decade of durations.
-- ARGV[1] how long the 10 s bucket lives after this write (ms)
-- ARGV[2] how long the 1 min bucket lives after this write (ms)
-- ARGV[3] the jobs' priority (a decimal integer), or 'other'
-- ARGV[4 ...] pairs: bin (a DDSketch key, or 'z' for 0 ms), count
--
-- Bounded work: at most MAX_PAIRS pairs per call (the caller sends more in
-- further calls, see engine/sketch.py); a longer call is refused whole. At
-- most MAX_PRIORITIES priorities get hashes of their own; later ones share
-- 'other', so the series an exporter reads stay bounded.
-- Returns the number of pairs added.

local MAX_PAIRS = 256
local MAX_PRIORITIES = 32 -- (engine/sketch.py says the same)
local pairs_n = (#ARGV - 3) / 2
if pairs_n > MAX_PAIRS or pairs_n ~= math.floor(pairs_n) then
  return redis.error_reply('ERR latency: at most ' .. MAX_PAIRS .. ' (bin, count) pairs per call')
end
local total = nil
if KEYS[5] and pairs_n > 0 then
  if ARGV[3] == 'other' then
    total = KEYS[4] -- the worker's own cap already folded this priority
  elseif redis.call('SISMEMBER', KEYS[5], ARGV[3]) == 1 then
    total = KEYS[3]
  elseif redis.call('SCARD', KEYS[5]) < MAX_PRIORITIES then
    redis.call('SADD', KEYS[5], ARGV[3])
    total = KEYS[3]
  else
    total = KEYS[4]
  end
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  if total then redis.call('HINCRBY', total, ARGV[i], ARGV[i + 1]) end
end
if pairs_n > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return pairs_n
