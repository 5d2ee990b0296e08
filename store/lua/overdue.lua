-- overdue: a placed or running job past its deadline fails, and its worker is asked to stop
-- (the cancel request a running job's worker acts on).
-- KEYS: job, running hash, events, done, leader, cancel, job counters, seconds, webhooks
-- ARGV: token, id, expected dispatch, error, failed event, events cap, finished ttl
-- Returns 1 failed, 0 the job moved on, -1 not the leader.
if fenced(KEYS[5], ARGV[1]) then return -1 end
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch')
if (cur[1] ~= 'placed' and cur[1] ~= 'running') or cur[2] ~= ARGV[3] then return 0 end
if redis.call('HGET', KEYS[2], ARGV[2]) == ARGV[3] then redis.call('HDEL', KEYS[2], ARGV[2]) end
redis.call('HSET', KEYS[1], 'error', ARGV[4])
ended(KEYS[1], KEYS[3], KEYS[4], 'failed', ARGV[5], ARGV[6], ARGV[7], KEYS[7], KEYS[8], KEYS[9])
redis.call('SET', KEYS[6], '1', 'EX', ARGV[7])
return 1
