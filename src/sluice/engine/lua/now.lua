-- now: the queue's clock, read on the server that holds the queue.
--
-- KEYS[1] any key of the queue (it routes the call to the queue's own server
--         on a Redis Cluster, whose masters' clocks may differ)
-- ARGV[1] now (ms, '' = Redis's clock: see includes/clock.lua)
--
-- Returns now (ms).

-- @include clock

return clock_ms(ARGV[1])
