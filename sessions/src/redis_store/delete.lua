-- Delete a response and its event log if it belongs to the team, leaving a marker that it was
-- deleted (for the history walk of the responses continuing it: a deleted predecessor is where
-- their history starts, a predecessor gone without a marker was lost).
-- KEYS[1]: hash of the response   KEYS[2]: its event log   KEYS[3]: its deletion marker
-- ARGV[1]: team that must own it   ARGV[2]: TTL in milliseconds for the marker: the store's
-- whole TTL (a response continuing this one may live that long after it was last written,
-- longer than what this one had left)
-- Returns 1 if deleted, 0 if missing or another team's.
if redis.call('HGET', KEYS[1], 'team') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return 1
