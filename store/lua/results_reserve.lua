-- results_reserve: room for one job's PNGs in the Redis result store, under its total cap.
-- Results whose time is up (their hash expired with RESULT_TTL) are uncounted first, a
-- hundred at a time; a job reserving again replaces its own earlier reservation.
-- KEYS: total, sizes, expiry (the RESULTS_KEYS), the job's result
-- ARGV: job id, bytes, cap (bytes), ttl (seconds)
-- Returns {1, total after} reserved, {0, total now} refused: the cap would be passed,
-- {-1, total now} nothing reserved: another run of the job already wrote its result (this
-- run's finish will find the job no longer ours).
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {-1, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
local t = redis.call('TIME')
local now = tonumber(t[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)) do
  release_result(KEYS[1], KEYS[2], KEYS[3], id)
end
release_result(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
local size = tonumber(ARGV[2])
local total = tonumber(redis.call('GET', KEYS[1]) or '0')
if total + size > tonumber(ARGV[3]) then
  return {0, total}
end
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1])
return {1, redis.call('INCRBY', KEYS[1], size)}
