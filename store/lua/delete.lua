-- delete: an ended job leaves Redis: every key it created, its place in `recent`, and its
-- share of the Redis result store. A live job is left alone (cancel it first).
-- KEYS: the job's keys (keys.job_keys, the record first), recent, then the RESULTS_KEYS
-- ARGV: job id, how many job keys lead KEYS
-- Returns 1 deleted, 0 no such job, -1 the job is live.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state ~= 'done' and state ~= 'failed' and state ~= 'cancelled' then return -1 end
local n = tonumber(ARGV[2])
redis.call('DEL', unpack(KEYS, 1, n))
redis.call('LREM', KEYS[n + 1], 0, ARGV[1])
release_result(KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], ARGV[1])
return 1
