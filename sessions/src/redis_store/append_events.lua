-- Append events to a response's event log, only while the response exists (a run still
-- streaming after its response was deleted must not bring the log back).
-- KEYS[1]: hash of the response   KEYS[2]: its event log
-- ARGV[1]: TTL in milliseconds    ARGV[2]: TTL of the log once the response has ended
-- ARGV[3..]: the events, in order
-- Returns 1 while the response is queued or in progress, 2 once it is not (cancelled, ended),
-- or 0 when it does not exist (nothing appended).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local status = redis.call('HGET', KEYS[1], 'status')
-- In slices: Lua's unpack has a limit on how many values it returns.
for first = 3, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
-- The log lives as long as its running response; once the response has ended, as long as a
-- client may still resume its stream.
if status == 'queued' or status == 'in_progress' then
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  return 1
end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 2
