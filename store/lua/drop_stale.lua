-- drop_stale: a pending entry whose record is gone (expired) or no longer queued.
-- KEYS: job, pending list, pending count. ARGV: id. Returns how many entries went.
if redis.call('HGET', KEYS[1], 'state') == 'queued' then return 0 end
local n = redis.call('LREM', KEYS[2], 0, ARGV[1])
if n > 0 then uncount(KEYS[3], n) end
return n
