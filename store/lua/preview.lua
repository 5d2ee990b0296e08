-- preview: the latest preview of a running job, kept in `preview:{id}` and appended to its
-- events. The events list keeps only the newest preview event (the one the key holds), so
-- previews, however many, never push the job's other events out of the capped list.
-- KEYS: preview, events. ARGV: preview event, events cap, finished ttl, job ttl.
local old = redis.call('GET', KEYS[1])
if old then
  redis.call('LREM', KEYS[2], -1, old)
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
log(KEYS[2], ARGV[1], ARGV[2], ARGV[4])
return 1
