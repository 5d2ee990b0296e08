-- start: the run of a job claimed ahead (claim_ahead.lua) has begun in its worker process,
-- which marked it locally first (sdfarm.worker.startmark). Written off the path, by the
-- worker's lookahead thread while the job prepares and runs: `ahead` cleared, so a loss from
-- now on counts as a run; `started`, the running event and the queue wait, as a claim writes.
-- KEYS: job, events, cancel, job counters (unused), seconds
-- ARGV: dispatch, started, running event, events cap, job ttl
-- Returns -1 when the job is no longer this dispatch's run, else cancel requested (0/1).
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'model', 'device')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] then
  return -1
end
redis.call('HDEL', KEYS[1], 'ahead')
redis.call('HSET', KEYS[1], 'started', ARGV[2])
log(KEYS[2], ARGV[3], ARGV[4], ARGV[5])
observe(KEYS[5], 'queue_wait', cur[3], cur[4], since_created(KEYS[1]))
return redis.call('EXISTS', KEYS[3])
