-- Delete a response and its event log if it belongs to the team.
-- KEYS[1]: hash of the response   KEYS[2]: its event log   ARGV[1]: team that must own it
-- Returns 1 if deleted, 0 if missing or another team's.
if redis.call('HGET', KEYS[1], 'team') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
