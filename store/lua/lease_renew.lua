-- lease_renew: extend the leader lease, only if `token` holds it.
-- KEYS: leader. ARGV: token, ttl ms. Returns 1 renewed, 0 not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
