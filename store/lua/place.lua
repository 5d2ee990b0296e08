-- place: a queued job goes to a device, and its Celery message onto that device's queue, in
-- one atomic step (placed and sent, or neither).
-- KEYS: job, pending list, running hash, pending count, events, leader, device's Celery queue
-- ARGV: token, id, dispatch, device, placed event, estimate, tier, events cap, message,
--       job ttl, tiling plan (JSON, '' when none)
-- Returns 1 placed, 0 the job is no longer queued (its stale pending entry is removed),
-- -1 not the leader.
if fenced(KEYS[6], ARGV[1]) then return -1 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then
  local n = redis.call('LREM', KEYS[2], 0, ARGV[2])
  if n > 0 then uncount(KEYS[4], n) end
  return 0
end
if redis.call('LREM', KEYS[2], 1, ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'placed', 'device', ARGV[4], 'dispatch', ARGV[3],
  'estimate', ARGV[6], 'tier', ARGV[7], 'placed', now(), 'tiling', ARGV[11] or '')
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
uncount(KEYS[4], 1)
log(KEYS[5], ARGV[5], ARGV[8], ARGV[10])
redis.call('LPUSH', KEYS[7], ARGV[9])
return 1
