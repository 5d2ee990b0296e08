-- loaded: after a model load, before the first native call of a job: keep the load's log
-- records in the job record (a crash then leaves them for the poison report) and say
-- whether a cancel came during the load.
-- KEYS: job, cancel. ARGV: records json. Returns 1 when a cancel is asked for.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'records', ARGV[1])
end
return redis.call('EXISTS', KEYS[2])
