-- How long, and how many, finished jobs a queue keeps: one setting per queue,
-- in its retention hash, so that every client and worker applies the same.
--
-- A finished job lands in the index of its kind (a sorted set scored by the
-- time it finished: finished:completed, finished:cancelled,
-- finished:rejected, finished:exhausted; dead-lettered jobs in the dead set) and its record
-- expires after the kind's age. Count caps, and the index entries of records
-- that expired, are trimmed by trim.lua in bounded steps.
--
-- Fields of the retention hash: <kind>_age (ms, 0 = no age limit) and
-- <kind>_count (0 = no count limit). A field not set takes the default below
-- (sluice.engine.retention documents them; tests/engine/test_retention.py checks
-- that both agree).
--
-- K needs: retention (hash), finp (prefix of the finished:<kind> sets), dead.

local RETENTION_KINDS = {'completed', 'dead', 'cancelled', 'rejected', 'exhausted'}
local RETENTION_DEFAULTS = {
  completed = {age = 86400000, count = 1000000},
  dead = {age = 30 * 86400000, count = 100000},
  cancelled = {age = 86400000, count = 100000},
  rejected = {age = 86400000, count = 100000},
  exhausted = {age = 30 * 86400000, count = 100000},
}

-- The queue's retention (read once per script call).
local function retention(K)
  if not K.ret then
    local fields = {}
    for _, kind in ipairs(RETENTION_KINDS) do
      fields[#fields + 1] = kind .. '_age'
      fields[#fields + 1] = kind .. '_count'
    end
    local v = redis.call('HMGET', K.retention, unpack(fields))
    K.ret = {}
    for i, kind in ipairs(RETENTION_KINDS) do
      local d = RETENTION_DEFAULTS[kind]
      K.ret[kind] = {age = tonumber(v[2 * i - 1]) or d.age, count = tonumber(v[2 * i]) or d.count}
    end
  end
  return K.ret
end

local function finished_set(K, kind)
  if kind == 'dead' then return K.dead end
  return K.finp .. kind
end

-- A job has just ended as `kind`: index it and let its record expire with the kind's age.
local function retain(K, kind, jk, id, now)
  redis.call('ZADD', finished_set(K, kind), now, id)
  local age = retention(K)[kind].age
  if age > 0 then redis.call('PEXPIRE', jk, age) end
end

-- How long a finished attempt's reservation record stays (it answers a settle sent
-- again): as long as a completed job's record, and never more than 8 days.
local function reservation_keep_ms(K)
  local age = retention(K).completed.age
  if age <= 0 then return 8 * 86400000 end
  return math.min(age, 8 * 86400000)
end
