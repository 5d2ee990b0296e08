-- prelude.lua: helpers every script of sdfarm.store may use (scripts.py prepends this file).

-- The Redis clock as "seconds.micros": one clock for every timestamp a script writes.
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end

-- Give a key that has no TTL yet the live job TTL (a key written before its job's first
-- write, or by an older client): every key a job creates expires.
local function live(k, ttl)
  if redis.call('TTL', k) == -1 then redis.call('EXPIRE', k, ttl) end
end

-- Append one event to a job's capped events list.
local function log(events, ev, cap, ttl)
  redis.call('RPUSH', events, ev)
  redis.call('LTRIM', events, -tonumber(cap), -1)
  live(events, ttl)
end

-- A write of the scheduler: refused unless `token` still holds the leader lease.
local function fenced(leader, token)
  return redis.call('GET', leader) ~= token
end

-- pending:count - n, never below zero.
local function uncount(count, n)
  if redis.call('DECRBY', count, n) < 0 then redis.call('SET', count, 0) end
end

-- The job's input images (the key its record names) get the finished TTL too.
local function expire_inputs(job, ttl)
  local inputs = redis.call('HGET', job, 'inputs')
  if inputs and inputs ~= '' then redis.call('EXPIRE', inputs, ttl) end
end

-- A job ends without a result: final state, event, the done token, and the finished TTL
-- on every key it has.
local function ended(job, events, done, state, ev, cap, ttl)
  redis.call('HSET', job, 'state', state, 'ended', now())
  log(events, ev, cap, ttl)
  redis.call('RPUSH', done, state)
  for _, k in ipairs({job, events, done}) do redis.call('EXPIRE', k, ttl) end
  expire_inputs(job, ttl)
end
