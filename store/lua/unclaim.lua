-- unclaim: a job claimed ahead that will not run in this process (its worker is stopping)
-- goes back to placed under the same dispatch, for whoever takes its message next.
-- KEYS: job, held hash
-- ARGV: dispatch, taker
-- Returns 1 unclaimed, 0 it moved on (or began) meanwhile.
redis.call('HDEL', KEYS[2], ARGV[2] .. ':job')
local cur = redis.call('HMGET', KEYS[1], 'state', 'dispatch', 'ahead')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] or not cur[3] or cur[3] == '' then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'placed')
redis.call('HDEL', KEYS[1], 'ahead', 'incarnation', 'worker')
return 1
