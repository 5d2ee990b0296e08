-- results_release: a reservation of the Redis result store given back (the job was no
-- longer ours, or its result was not written after all).
-- KEYS: total, sizes, expiry (the RESULTS_KEYS)
-- ARGV: job id
release_result(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
return 1
