-- results_release: a reservation of the Redis result store given back (the job was no
-- longer ours, or its result was not written after all).
-- A result another run of the job wrote meanwhile keeps its share (its reserve replaced
-- this run's).
-- KEYS: total, sizes, expiry (the RESULTS_KEYS), the job's result
-- ARGV: job id
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
release_result(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
return 1
