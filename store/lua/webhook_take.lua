-- webhook_take: the leader takes the webhooks that are due: each one's next try is pushed
-- `lease` seconds ahead before it is sent, so a deliverer that dies between the send and the
-- settle leaves it to be sent again once the lease runs out (at least once), and no other
-- scheduler takes it meanwhile. The try is counted here, before the send, so a crash in the
-- middle still counts. A job whose record expired is dropped from the queue.
-- KEYS: webhooks, leader
-- ARGV: token, lease seconds, at most how many, job key prefix
-- Returns {id, tries, id, tries, ...}, or -1 not the leader.
if fenced(KEYS[2], ARGV[1]) then return -1 end
local t = tonumber(now())
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', t), 'LIMIT', 0,
  tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local job = ARGV[4] .. id
  if redis.call('EXISTS', job) == 0 then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], 'XX', string.format('%.6f', t + tonumber(ARGV[2])), id)
    table.insert(out, id)
    table.insert(out, redis.call('HINCRBY', job, 'webhook_tries', 1))
  end
end
return out
