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

-- Append one event to a job's capped events list, and publish it on the channel named like
-- the list (keys.events_channel): waiters and event streams wake on it instead of polling.
local function log(events, ev, cap, ttl)
  redis.call('RPUSH', events, ev)
  redis.call('PUBLISH', events, ev)
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

-- The farm's metrics (sdfarm.store.metrics; METRICS_* are put in front by scripts.py): the
-- field of a series, its model folded into METRICS_OTHER when the hash is full and the
-- series is new (`probe`: the suffix of a field every series has, `per`: fields per series).
local function series(hash, kind, model, device, probe, per)
  local f = kind .. '|' .. (model or '') .. '|' .. (device or '')
  if redis.call('HEXISTS', hash, f .. probe) == 0
      and redis.call('HLEN', hash) >= METRICS_CAP * per then
    f = kind .. '|' .. METRICS_OTHER .. '|' .. (device or '')
  end
  return f
end

-- Count one job of `kind` (submitted, done, failed, cancelled, requeued).
local function count(counters, kind, model, device)
  redis.call('HINCRBY', counters, series(counters, kind, model, device, '', 1), 1)
end

-- One observation of histogram `name`: its bucket (not cumulative) and its sum.
local function observe(seconds, name, model, device, value)
  if not value or value < 0 then return end
  local f = series(seconds, name, model, device, '|sum', #METRICS_BOUNDS + 2)
  local le = '+Inf'
  for i, b in ipairs(METRICS_BOUNDS) do
    if value <= b then le = METRICS_LABELS[i]; break end
  end
  redis.call('HINCRBY', seconds, f .. '|' .. le, 1)
  redis.call('HINCRBYFLOAT', seconds, f .. '|sum', value)
end

-- Seconds since the job was submitted, on the Redis clock (nil without a `created`).
local function since_created(job)
  local created = tonumber(redis.call('HGET', job, 'created') or '')
  if not created then return nil end
  return tonumber(now()) - created
end

-- A job reached final `state`: counted by model and device, its end-to-end time observed.
local function count_end(job, state, counters, seconds)
  local f = redis.call('HMGET', job, 'model', 'device')
  count(counters, state, f[1], f[2])
  observe(seconds, 'end_to_end', f[1], f[2], since_created(job))
end

-- A job that ended with a webhook: its id goes into the delivery queue `hooks` (a zset of
-- job id -> when its next try is due), due now, in the same step as the transition, so an
-- ended job is never left untold (sdfarm.scheduler.webhooks sends it). The queue is farm-wide
-- and bounded (WEBHOOKS_CAP, put in front by scripts.py): when full, the job gets a failed
-- delivery event instead.
local function notify(job, events, hooks, cap, ttl)
  local f = redis.call('HMGET', job, 'webhook', 'id')
  if not f[1] or f[1] == '' or not f[2] then return end
  if redis.call('ZCARD', hooks) >= WEBHOOKS_CAP then
    log(events, cjson.encode({event = 'webhook', outcome = 'failed', tries = 0,
      error = "the farm's webhook queue is full", t = tonumber(now())}), cap, ttl)
    return
  end
  redis.call('ZADD', hooks, 'NX', now(), f[2])
end

-- A job ends without a result: final state, event, the done token, the finished TTL on every
-- key it has, the metrics, and its webhook queued.
local function ended(job, events, done, state, ev, cap, ttl, counters, seconds, hooks)
  redis.call('HSET', job, 'state', state, 'ended', now())
  redis.call('HDEL', job, 'ahead', 'spared')
  log(events, ev, cap, ttl)
  redis.call('RPUSH', done, state)
  for _, k in ipairs({job, events, done}) do redis.call('EXPIRE', k, ttl) end
  expire_inputs(job, ttl)
  count_end(job, state, counters, seconds)
  notify(job, events, hooks, cap, ttl)
end

-- Uncount a result the Redis result store held (sdfarm.store.results): its bytes leave the
-- total (`total`, `sizes`, `expiry`: the RESULTS_KEYS).
local function release_result(total, sizes, expiry, id)
  local size = tonumber(redis.call('HGET', sizes, id) or '')
  if size then
    if redis.call('DECRBY', total, size) < 0 then redis.call('SET', total, 0) end
    redis.call('HDEL', sizes, id)
  end
  redis.call('ZREM', expiry, id)
end
