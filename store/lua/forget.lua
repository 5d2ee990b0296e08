-- forget: drop a stale running entry (the job ended or was re-placed and its worker could
-- not clean up), only if it still names `dispatch`.
-- KEYS: running hash, leader. ARGV: token, id, dispatch.
-- Returns 1 removed, 0 it changed meanwhile, -1 not the leader.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[2])
