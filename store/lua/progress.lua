-- progress: the latest step of a running job and its step event; says whether a cancel is
-- asked for (the worker checks on every progress write).
-- KEYS: progress, events, cancel. ARGV: progress json, step event, events cap, finished ttl,
-- job ttl. Returns 1 when a cancel is asked for.
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
log(KEYS[2], ARGV[2], ARGV[3], ARGV[5])
return redis.call('EXISTS', KEYS[3])
