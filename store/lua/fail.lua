-- fail: a queued job that no device could ever hold fails with the estimate and figures.
-- KEYS: job, pending list, pending count, events, done, leader, job counters, seconds, webhooks
-- ARGV: token, id, error, figures json, failed event, events cap, finished ttl, estimate
-- Returns 1 failed, 0 no longer queued, -1 not the leader.
if fenced(KEYS[6], ARGV[1]) then return -1 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
if redis.call('LREM', KEYS[2], 1, ARGV[2]) == 0 then return 0 end
uncount(KEYS[3], 1)
redis.call('HSET', KEYS[1], 'error', ARGV[3], 'figures', ARGV[4], 'estimate', ARGV[8])
ended(KEYS[1], KEYS[4], KEYS[5], 'failed', ARGV[5], ARGV[6], ARGV[7], KEYS[7], KEYS[8], KEYS[9])
return 1
