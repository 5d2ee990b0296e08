-- claim_ahead: a worker's lookahead claims the next job during the native call of the one
-- before it (sdfarm.worker.chain), so that no claim lies on the path between two images. The
-- job is running under the worker's incarnation as after a claim, with `ahead` (when it was
-- claimed) until its run begins (start.lua); the slot's held entry names it, so that the
-- slot's next process can settle it (restore_held.lua). A job lost while `ahead` never began:
-- the scheduler re-places it without counting an attempt. A job claimed ahead leaves room in
-- its device's backlog (sdfarm.scheduler.registry): the scheduler is woken, as by a finish,
-- when jobs are pending, so that the next message is in the queue before this job begins.
-- KEYS: job, cancel, held hash (sdfarm.store.transport.held_key), wake, pending count
-- ARGV: dispatch, incarnation, worker, taker, claimed (Redis-clock-free: the worker's time),
--       wake cap, job id
-- Returns 0 when stale, else {spec, created, estimate, cancel requested (0/1), tiling plan}.
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'spec', 'created', 'estimate',
                      'tiling', 'ahead', 'incarnation')
-- claimed ahead by this process already (a retry after a reply it did not hear): the same
local again = cur[1] == 'running' and cur[7] and cur[7] ~= '' and cur[8] == ARGV[2]
if (cur[1] ~= 'placed' and not again) or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'running', 'ahead', ARGV[5],
           'incarnation', ARGV[2], 'worker', ARGV[3])
redis.call('HSET', KEYS[3], ARGV[4] .. ':job', ARGV[1] .. ' ' .. KEYS[1])
if tonumber(redis.call('GET', KEYS[5]) or '0') > 0 then
  redis.call('LPUSH', KEYS[4], ARGV[7])
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[6]) - 1)
end
return {cur[3] or '', cur[4] or '', cur[5] or '', redis.call('EXISTS', KEYS[2]), cur[6] or ''}
