-- event: append one event to a job's capped list.
-- KEYS: events. ARGV: event, events cap, job ttl.
log(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return 1
