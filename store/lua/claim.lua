-- claim: a worker takes a placed job for the dispatch its message names; a stale message
-- (the job was re-placed, cancelled or already ran) claims nothing. A job this same worker
-- process claimed ahead (claim_ahead.lua; it may not have heard the reply) is claimed again.
-- KEYS: job, events, cancel, job counters (unused), seconds
-- ARGV: dispatch, incarnation, started, running event, events cap, worker, job ttl
-- Returns 0 when stale, else {spec, created, estimate, cancel requested (0/1), tiling plan}.
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'spec', 'created', 'estimate',
                      'model', 'device', 'tiling', 'ahead', 'incarnation')
local mine = cur[1] == 'running' and cur[9] and cur[9] ~= '' and cur[10] == ARGV[2]
if (cur[1] ~= 'placed' and not mine) or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[1], 'ahead', 'spared')
redis.call('HSET', KEYS[1], 'state', 'running', 'started', ARGV[3],
           'incarnation', ARGV[2], 'worker', ARGV[6])
log(KEYS[2], ARGV[4], ARGV[5], ARGV[7])
observe(KEYS[5], 'queue_wait', cur[6], cur[7], since_created(KEYS[1]))
return {cur[3] or '', cur[4] or '', cur[5] or '', redis.call('EXISTS', KEYS[3]), cur[8] or ''}
