-- finish: a worker ends a running job of its dispatch: the result (images, meta, records),
-- the final state, its running entry, the done token and the event, in one round trip. A job
-- that is no longer ours (re-placed, or ended by someone else) is left alone. It wakes the
-- scheduler only when jobs are pending: a freed slot is news only to them.
-- It counts the end and observes the job's end-to-end, load and generate seconds, and queues
-- the job's webhook.
-- KEYS: job, result, done, events, running, wake, progress, recent, pending count, cancel,
--       job counters, seconds, preview (the latest preview: the result supersedes it),
--       webhooks
-- ARGV: dispatch, state, error, ended, event, events cap, finished ttl, job id, meta,
--       records, count, wake cap, recent cap, load seconds ('' when the job loaded
--       nothing), generate seconds ('' when none), n (how many job field ARGVs follow), the n
--       job field ARGVs (name, value pairs), then the result's images (png:0, bytes, ...)
-- Returns 1 ended, 0 not ours.
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'ahead', 'incarnation', 'worker')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] then
  return 0
end
local ttl = tonumber(ARGV[7])
local n = tonumber(ARGV[16])
if cur[3] and cur[3] ~= '' then
  -- Claimed ahead, and its start never reached Redis (start.lua failed, or was lost with a
  -- master that died before its replica had it): it ran, so its run is recorded here.
  redis.call('HSET', KEYS[1], 'started', cur[3])
  log(KEYS[4], cjson.encode({event = 'running', t = tonumber(cur[3]), incarnation = cur[4],
                             worker = cur[5], recorded = 'at its end'}), ARGV[6], ttl)
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'error', ARGV[3], 'ended', ARGV[4])
redis.call('HDEL', KEYS[1], 'ahead', 'spared')
if n > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 17, 16 + n))
end
if ARGV[9] ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'meta', ARGV[9], 'records', ARGV[10], 'count', ARGV[11])
  if #ARGV > 16 + n then
    redis.call('HSET', KEYS[2], unpack(ARGV, 17 + n))
  end
  redis.call('EXPIRE', KEYS[2], ttl)
end
if redis.call('HGET', KEYS[5], ARGV[8]) == ARGV[1] then
  redis.call('HDEL', KEYS[5], ARGV[8])
end
redis.call('RPUSH', KEYS[3], ARGV[2])
log(KEYS[4], ARGV[5], ARGV[6], ttl)
redis.call('DEL', KEYS[13])
for _, k in ipairs({KEYS[1], KEYS[3], KEYS[4], KEYS[7], KEYS[10]}) do
  redis.call('EXPIRE', k, ttl)
end
expire_inputs(KEYS[1], ttl)
if tonumber(redis.call('GET', KEYS[9]) or '0') > 0 then
  redis.call('LPUSH', KEYS[6], ARGV[8])
  redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[12]) - 1)
end
if ARGV[2] == 'done' then
  redis.call('LPUSH', KEYS[8], ARGV[8])
  redis.call('LTRIM', KEYS[8], 0, tonumber(ARGV[13]) - 1)
end
local labels = redis.call('HMGET', KEYS[1], 'model', 'device')
count_end(KEYS[1], ARGV[2], KEYS[11], KEYS[12])
notify(KEYS[1], KEYS[4], KEYS[14], ARGV[6], ttl)
observe(KEYS[12], 'load', labels[1], labels[2], tonumber(ARGV[14]))
observe(KEYS[12], 'generate', labels[1], labels[2], tonumber(ARGV[15]))
return 1
