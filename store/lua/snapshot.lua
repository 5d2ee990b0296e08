-- snapshot: the whole farm in one round trip, for one scheduler cycle (or a status read):
-- every known device's heartbeat, running entries and their jobs' fields, the heads of the
-- pending lists and the fields of the first few of them (a job submitted to an idle farm is
-- placed without a second read), and optionally the wake nudges cleared in the same atomic
-- step, so a nudge that lands after the read is never lost. It builds heartbeat, running and
-- job keys from prefixes: fine on one Redis (the farm's), not on a Redis Cluster.
-- KEYS: devices set, wake, pending lists (0 or more)
-- ARGV: clear wake (0/1), heartbeat key prefix, running key prefix, job key prefix, heads to
--       read per pending list, how many of them to read the fields of, n, then the n fields
--       to read of running jobs, then the fields to read of pending jobs
-- Returns {{device, heartbeat, running hash, running jobs' fields}...}, heads, heads' fields,
-- and the Redis clock (the one every timestamp a script writes is read on)
local known = redis.call('SMEMBERS', KEYS[1])
if ARGV[1] == '1' then redis.call('DEL', KEYS[2]) end
local n = tonumber(ARGV[7])
local fields, pfields = {}, {}
for i = 8, 7 + n do fields[#fields + 1] = ARGV[i] end
for i = 8 + n, #ARGV do pfields[#pfields + 1] = ARGV[i] end
local devices = {}
for i, d in ipairs(known) do
  local hb = redis.call('GET', ARGV[2] .. d)
  local running = redis.call('HGETALL', ARGV[3] .. d)
  local jobs = {}
  for j = 1, #running, 2 do
    jobs[#jobs + 1] = redis.call('HMGET', ARGV[4] .. running[j], unpack(fields))
  end
  devices[i] = {d, hb, running, jobs}
end
local heads, facts = {}, {}
local scan, nfacts = tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 3, #KEYS do
  local ids = redis.call('LRANGE', KEYS[i], 0, scan - 1)
  local got = {}
  for j = 1, math.min(nfacts, #ids) do
    got[j] = redis.call('HMGET', ARGV[4] .. ids[j], unpack(pfields))
  end
  heads[#heads + 1] = ids
  facts[#facts + 1] = got
end
return {devices, heads, facts, now()}
