-- cancel: a queued job ends at once; a placed or running one gets a cancel request that its
-- worker acts on.
-- KEYS: job, pending count, events, done, cancel, pending list, job counters, seconds, webhooks
-- ARGV: id, cancelled event, events cap, finished ttl
-- Returns 1 cancelled while queued, 2 cancel requested (placed/running), 0 already ended.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' then
  local n = redis.call('LREM', KEYS[6], 0, ARGV[1])
  if n > 0 then uncount(KEYS[2], n) end
  ended(KEYS[1], KEYS[3], KEYS[4], 'cancelled', ARGV[2], ARGV[3], ARGV[4], KEYS[7], KEYS[8], KEYS[9])
  return 1
end
if state == 'placed' or state == 'running' then
  redis.call('SET', KEYS[5], '1', 'EX', ARGV[4])
  return 2
end
return 0
