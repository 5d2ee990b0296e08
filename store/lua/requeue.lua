-- requeue: a job whose worker was lost goes back to the front of its pending list with a new
-- dispatch id, or fails as poison after `max attempts` lost runs, or ends cancelled when a
-- cancel was asked for meanwhile.
-- KEYS: job, running hash, pending list, pending count, events, done, leader, cancel,
--       job counters, seconds, webhooks
-- ARGV: token, id, expected state, expected dispatch, new dispatch, count attempt (0/1),
--       max attempts, device, retried event, failed event, cancelled event, poison error,
--       events cap, finished ttl, job ttl
-- Returns 1 requeued, 2 poisoned, 3 cancelled, 0 the job moved on, -1 not the leader.
if fenced(KEYS[7], ARGV[1]) then return -1 end
local state = redis.call('HGET', KEYS[1], 'state')
local dispatch = redis.call('HGET', KEYS[1], 'dispatch')
if state ~= ARGV[3] or dispatch ~= ARGV[4] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[8]) == 1 then
  ended(KEYS[1], KEYS[5], KEYS[6], 'cancelled', ARGV[11], ARGV[13], ARGV[14], KEYS[9], KEYS[10], KEYS[11])
  return 3
end
if ARGV[6] == '1' then
  local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  local lost = redis.call('HGET', KEYS[1], 'lost_on')
  if lost and lost ~= '' then lost = lost .. ',' .. ARGV[8] else lost = ARGV[8] end
  redis.call('HSET', KEYS[1], 'lost_on', lost)
  if attempts >= tonumber(ARGV[7]) then
    redis.call('HSET', KEYS[1], 'error', ARGV[12])
    ended(KEYS[1], KEYS[5], KEYS[6], 'failed', ARGV[10], ARGV[13], ARGV[14], KEYS[9], KEYS[10], KEYS[11])
    return 2
  end
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'device', '', 'dispatch', ARGV[5],
  'incarnation', '')
redis.call('HDEL', KEYS[1], 'ahead', 'spared')
redis.call('LPUSH', KEYS[3], ARGV[2])
redis.call('INCR', KEYS[4])
count(KEYS[9], 'requeued', redis.call('HGET', KEYS[1], 'model'), ARGV[8])
log(KEYS[5], ARGV[9], ARGV[13], ARGV[15])
return 1
