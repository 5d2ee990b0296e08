-- webhook_settle: the outcome of one try of a job's webhook. `retry` makes it due again in
-- `delay` seconds; `delivered` and `failed` (the last try failed) take it off the queue and
-- write the outcome into the job record. Every outcome is a job event. Not fenced: the try
-- happened whoever leads now, and a retry only moves a queued entry (ZADD XX), never adds one.
-- KEYS: webhooks, job, events
-- ARGV: id, outcome (delivered, failed, retry), delay seconds, event, events cap, finished ttl
-- Returns 1, or 0 when the webhook was no longer queued.
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
if ARGV[2] == 'retry' then
  redis.call('ZADD', KEYS[1], 'XX', string.format('%.6f', tonumber(now()) + tonumber(ARGV[3])),
    ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('HSET', KEYS[2], 'webhook_state', ARGV[2])
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then log(KEYS[3], ARGV[4], ARGV[5], ARGV[6]) end
return 1
