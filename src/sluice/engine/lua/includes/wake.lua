-- wake_if_waiting(waiting_key, wake_key)
-- Idle workers block with BZPOPMIN on the wake key, which holds at most one
-- marker. Whoever leaves jobs in waiting puts the marker back, so one idle
-- worker wakes per marker and the wake-ups cascade while work remains.
local function wake_if_waiting(waiting_key, wake_key)
  if redis.call('ZCARD', waiting_key) > 0 then
    redis.call('ZADD', wake_key, 0, 'w')
  end
end
