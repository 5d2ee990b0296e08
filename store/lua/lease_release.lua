-- lease_release: give the leader lease up, only if `token` holds it.
-- KEYS: leader. ARGV: token. Returns 1 released, 0 not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
