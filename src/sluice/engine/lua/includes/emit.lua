-- emit(events_key, maxlen, event, job_id [, field, value ...])
-- Appends one lifecycle event to the queue's capped stream (approximate trim,
-- which Redis does in whole macro-nodes and so costs next to nothing).
local function emit(events_key, maxlen, event, job_id, ...)
  redis.call('XADD', events_key, 'MAXLEN', '~', maxlen, '*', 'ev', event, 'id', job_id, ...)
end
