-- submit: queue a new job unless the queue is full or its owner is at its live-jobs quota.
-- Idempotent: a retry of a submit whose reply was lost (the connection dropped) finds its job
-- and queues nothing twice.
-- KEYS: job, pending list, pending count, events, wake, config, inputs, owned (the owner's
--       admitted jobs; any key when there is no quota), job counters, seconds histograms
-- ARGV: id, default queue limit, queued event, events cap, job ttl, wake cap, quota (live jobs
--       the owner may have; 0: none), job key prefix, n (how many input ARGVs follow), the n
--       input ARGVs (name, bytes pairs: the job's images), then the record's field/value pairs
-- Returns {1, depth, limit} when queued, {0, depth, limit} when the queue is full,
-- {-1, live, quota} when the owner has `quota` live jobs already.
local limit = tonumber(redis.call('HGET', KEYS[6], 'queue_limit') or ARGV[2])
local depth = tonumber(redis.call('GET', KEYS[3]) or '0')
if redis.call('EXISTS', KEYS[1]) == 1 then return {1, depth, limit} end
if depth >= limit then return {0, depth, limit} end
local quota = tonumber(ARGV[7])
if quota > 0 then
  -- the owner's live jobs: prune those that ended (or expired), then count the rest
  local live = 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
    local state = redis.call('HGET', ARGV[8] .. id, 'state')
    if state == 'queued' or state == 'placed' or state == 'running' then
      live = live + 1
    else
      redis.call('ZREM', KEYS[8], id)
    end
  end
  if live >= quota then return {-1, live, quota} end
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[8], tonumber(t[1]), ARGV[1])
  redis.call('EXPIRE', KEYS[8], ARGV[5])
end
local n = tonumber(ARGV[9])
redis.call('HSET', KEYS[1], unpack(ARGV, 10 + n))
redis.call('HSET', KEYS[1], 'created', now())
redis.call('EXPIRE', KEYS[1], ARGV[5])
if n > 0 then
  redis.call('HSET', KEYS[7], unpack(ARGV, 10, 9 + n))
  redis.call('EXPIRE', KEYS[7], ARGV[5])
  redis.call('HSET', KEYS[1], 'inputs', KEYS[7])
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
count(KEYS[9], 'submitted', redis.call('HGET', KEYS[1], 'model'), '')
log(KEYS[4], ARGV[3], ARGV[4], ARGV[5])
redis.call('LPUSH', KEYS[5], '1')
redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[6]) - 1)
return {1, depth + 1, limit}
