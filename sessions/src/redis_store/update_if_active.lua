-- Replace a response's Response object and output items only while it is still running.
-- KEYS[1]: hash of the response   KEYS[2]: its event log (TTL refreshed with it, if any)
-- ARGV[1]: team that must own it
-- ARGV[2]: new Response object (JSON)   ARGV[3]: new output items (JSON array)
-- ARGV[4]: new status                   ARGV[5]: "1" if the output is shared with the response
-- ARGV[6]: TTL in milliseconds       ARGV[7]: TTL of the event log once the response has ended
-- Returns 1 if applied, 0 if missing, another team's, or no longer queued/in_progress.
local current = redis.call('HMGET', KEYS[1], 'team', 'status')
if current[1] ~= ARGV[1] then
  return 0
end
if current[2] ~= 'queued' and current[2] ~= 'in_progress' then
  return 0
end
redis.call('HSET', KEYS[1], 'response', ARGV[2], 'output', ARGV[3], 'status', ARGV[4], 'shared', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
if ARGV[4] == 'queued' or ARGV[4] == 'in_progress' then
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
return 1
