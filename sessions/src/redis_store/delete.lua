-- Delete a response and its event log if it belongs to the team, leaving a marker that it was
-- deleted (for the history walk of the responses continuing it: a deleted predecessor is where
-- their history starts, a predecessor gone without a marker was lost).
-- KEYS[1]: hash of the response   KEYS[2]: its event log   KEYS[3]: its deletion marker
-- ARGV[1]: team that must own it   ARGV[2]: TTL in milliseconds for the marker when the
-- response has none left (the marker otherwise lives as long as the response would have)
-- Returns 1 if deleted, 0 if missing or another team's.
if redis.call('HGET', KEYS[1], 'team') ~= ARGV[1] then
  return 0
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl <= 0 then
  ttl = ARGV[2]
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SET', KEYS[3], '1', 'PX', ttl)
return 1
