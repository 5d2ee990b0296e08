-- restore_held: a slot's new process settles what its last process left, which may have died
-- (sdfarm.worker.startmark): the job whose run it began last is the one an abort is charged
-- to, and nothing else is.
-- * The message it took goes back to the head of its list, unless its job began there.
-- * The job it claimed ahead (claim_ahead.lua), if any: when the start mark names it, its run
--   began before the process died: its `ahead` is cleared, so that the scheduler counts its
--   loss like any run's; otherwise it never began and goes back to placed under the same
--   dispatch, its message with it.
-- * Every other job still running under the dead process (one whose native call had ended and
--   whose result was still being written when the next job aborted) is `spared`: the scheduler
--   re-places it without counting an attempt.
-- KEYS: held hash, the held job's record (the held hash again when none is named), the
--       device's running hash
-- ARGV: taker, the held job's dispatch ('' when none), 1 when the start mark names that job,
--       the mark's job id ('' when no mark), the mark's incarnation, the job key prefix
-- Returns {message put back (0/1), the held job: 'unclaimed', 'charged' or '', jobs spared}.
local spared = 0
if ARGV[5] ~= '' then
  for _, id in ipairs(redis.call('HKEYS', KEYS[3])) do
    if id ~= ARGV[4] then
      local job = ARGV[6] .. id
      local f = redis.call('HMGET', job, 'state', 'incarnation', 'ahead')
      if f[1] == 'running' and f[2] == ARGV[5] and not (f[3] and f[3] ~= '') then
        redis.call('HSET', job, 'spared', '1')
        spared = spared + 1
      end
    end
  end
end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local list = redis.call('HGET', KEYS[1], ARGV[1] .. ':list')
redis.call('HDEL', KEYS[1], ARGV[1], ARGV[1] .. ':list', ARGV[1] .. ':job')
local settled = ''
if ARGV[2] ~= '' then
  local cur = redis.call('HMGET', KEYS[2], 'state', 'dispatch', 'ahead')
  if cur[1] == 'running' and cur[2] == ARGV[2] and cur[3] and cur[3] ~= '' then
    if ARGV[3] == '1' then
      redis.call('HDEL', KEYS[2], 'ahead', 'spared')
      redis.call('HSET', KEYS[2], 'started', cur[3])
      settled = 'charged'
    else
      redis.call('HSET', KEYS[2], 'state', 'placed')
      redis.call('HDEL', KEYS[2], 'ahead', 'incarnation', 'worker')
      settled = 'unclaimed'
    end
  end
  if cur[1] ~= 'placed' and settled ~= 'unclaimed' then
    return {0, settled, spared}  -- its job ran or runs: the message is spent
  end
end
if raw and list then
  redis.call('RPUSH', list, raw)
  return {1, settled, spared}
end
return {0, settled, spared}
