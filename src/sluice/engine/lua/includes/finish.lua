-- finish_one(K, jk, id, token, kind, value, retry_at, usage, now, C) -> code
-- Records the outcome of one leased job, fenced by its attempt token, and
-- settles the attempt's token reservation (if it has one).
--
-- kind (KIND in the wire include, generated from engine/wireformat.py):
--       'c' completed (value = result JSON)
--       'f' failed (value = error text; retried at retry_at while attempts
--           remain, else dead-lettered)
--       'p' failed permanently (dead-lettered now)
--       'o' failed by overrunning its timeout and being stopped hard (as 'f',
--           and counted as 'overrun')
--       'r' released unfinished (back to waiting; the attempt is not counted)
--       'x' cancelled while running (after a cancel request)
--       't' throttled by the provider (value = retry after, ms): the queue
--           dispatches nothing until then; the job goes back to waiting at
--           its priority, its attempt not counted, its reservation refunded
-- usage: tokens the attempt used as the handler reported them, or -1. The
-- reservation is committed with it; without it, a completed attempt keeps
-- its estimate charged, and any other outcome keeps it charged as an
-- "unknown outcome" (the provider may have been called). A throttled attempt
-- is refunded: the provider refused the call.
-- A job whose cancellation was requested ends cancelled unless it completed.
-- Returns 1 completed, 2 retry scheduled, 3 dead-lettered, 4 released,
-- 5 cancelled, 6 throttled, 0 refused (token stale or job no longer active),
-- -1 no such job.
-- C accumulates counters, written once per script call by flush_counts.
-- K also needs: dead, retention, finp (see retention.lua), maxlen, ev_result_max.

-- @include wire
-- @include ledger
-- @include retention
-- @include dispatch

-- What the handler reported is charged, whatever the outcome: the provider
-- billed it (a throttle that reports usage was served, then asked to slow
-- down). Without a report: a completion keeps its estimate, a throttle is
-- refunded (the provider refused the call), anything else keeps the estimate
-- as an unknown outcome.
-- The outcome of an attempt as the job record's spend list names it, by kind.
local OUTCOMES = {[KIND.completed] = 'completed', [KIND.failed] = 'failed', [KIND.permanent] = 'failed',
                  [KIND.overran] = 'timed out', [KIND.released] = 'released',
                  [KIND.cancelled] = 'cancelled', [KIND.throttled] = 'throttled'}

local function settle_attempt(K, jk, id, token, rid, kind, usage, now, C)
  if usage >= 0 then redis.call('HSET', jk, 'usage', usage) end
  -- ('rid' names the last attempt that reserved: not this one, if this one did not)
  if rid ~= id .. ':' .. token then return end
  local how = 'commit'
  if usage < 0 and kind == KIND.throttled then
    how = 'refund'
  elseif usage < 0 and kind ~= KIND.completed then
    how = 'unknown'
  end
  local _, changed, _, crossed = settle(K, rid, how, usage, now, reservation_keep_ms(K))
  if changed and how == 'unknown' then C.unknown_outcome = C.unknown_outcome + 1 end
  emit_overspent(K, crossed, id, rid)
  record_spend(K, jk, rid, OUTCOMES[kind] or kind, usage)
end

local function finish_one(K, jk, id, token, kind, value, retry_at, usage, now, C)
  local cur = redis.call('HMGET', jk, 'state', 'token', 'attempt', 'max_attempts', 'failures', 'score',
                         'cancel', 'rid')
  if not cur[1] then return -1 end
  if cur[1] ~= 'active' or cur[2] ~= token then
    C.stale_refused = C.stale_refused + 1
    return 0
  end
  redis.call('ZREM', K.active, id)
  settle_attempt(K, jk, id, token, cur[8], kind, usage, now, C)
  if kind == KIND.overran then
    -- Overran its timeout and was stopped hard (its process ended): a failure,
    -- counted apart so that an operator sees it without reading errors.
    C.overrun = C.overrun + 1
    kind = KIND.failed
  end
  -- A record whose numbers do not parse (damaged by another writer) must not
  -- fail the whole batch: missing numbers count as 0, a missing score dead-letters.
  local attempt = tonumber(cur[3]) or 0
  local score = cur[6]
  -- A cancel requested while the attempt ran wins over anything but success:
  -- the job must not go back to waiting and run again.
  if cur[7] and kind ~= KIND.completed then
    if kind == KIND.failed or kind == KIND.permanent then redis.call('HSET', jk, 'error', value) end
    kind = KIND.cancelled
  end
  if kind == KIND.completed then
    redis.call('HSET', jk, 'state', 'completed', 'finished', now, 'result', value)
    retain(K, 'completed', jk, id, now)
    C.completed = C.completed + 1
    if #value <= K.ev_result_max then
      emit(K.events, K.maxlen, 'completed', id, 'result', value)
    else
      emit(K.events, K.maxlen, 'completed', id)
    end
    return 1
  elseif kind == KIND.cancelled then
    redis.call('HSET', jk, 'state', 'cancelled', 'finished', now)
    retain(K, 'cancelled', jk, id, now)
    C.cancelled = C.cancelled + 1
    emit(K.events, K.maxlen, 'cancelled', id)
    return 5
  elseif (kind == KIND.released or kind == KIND.throttled) and score then
    redis.call('HSET', jk, 'state', 'waiting', 'attempt', math.max(attempt - 1, 0))
    redis.call('ZADD', K.waiting, score, id)
    if kind == KIND.released then
      C.released = C.released + 1
      emit(K.events, K.maxlen, 'released', id)
      return 4
    end
    local retry_after = math.max(tonumber(value) or 0, 0)
    local until_ms = now + retry_after
    local cur_until = tonumber(redis.call('HGET', K.control, 'throttled_until')) or 0
    if until_ms > cur_until then redis.call('HSET', K.control, 'throttled_until', until_ms) end
    slow_down(K, now)
    C.throttled = C.throttled + 1
    emit(K.events, K.maxlen, 'throttled', id, 'retry_after_ms', retry_after)
    return 6
  end
  -- kind 'f' or 'p': a failed attempt
  if kind == KIND.released or kind == KIND.throttled then
    value = 'record has no waiting score; cannot be released'
  end
  redis.call('HSET', jk, 'failures', (tonumber(cur[5]) or 0) + 1)
  C.failed = C.failed + 1
  emit(K.events, K.maxlen, 'failed', id, 'error', value)
  if kind ~= KIND.failed or not score or attempt >= (tonumber(cur[4]) or 0) then
    redis.call('HSET', jk, 'state', 'dead', 'finished', now, 'error', value)
    retain(K, 'dead', jk, id, now)
    C.dead = C.dead + 1
    emit(K.events, K.maxlen, 'dead', id, 'error', value)
    return 3
  end
  if retry_at <= now then
    redis.call('HSET', jk, 'state', 'waiting', 'error', value)
    redis.call('ZADD', K.waiting, score, id)
  else
    redis.call('HSET', jk, 'state', 'delayed', 'error', value, 'due', retry_at)
    redis.call('ZADD', K.delayed, retry_at, id)
  end
  C.retried = C.retried + 1
  emit(K.events, K.maxlen, 'retrying', id, 'at', retry_at)
  return 2
end

local function new_counts()
  return {completed = 0, failed = 0, dead = 0, retried = 0, released = 0, cancelled = 0,
          stale_refused = 0, throttled = 0, rejected = 0, exhausted = 0, orphaned = 0, unknown_outcome = 0,
          overrun = 0}
end

local function flush_counts(stats_key, C)
  for name, n in pairs(C) do
    if n > 0 then redis.call('HINCRBY', stats_key, name, n) end
  end
end
