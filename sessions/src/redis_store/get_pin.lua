-- Read a session pin and refresh its TTL (a pin read is a turn of its session).
-- KEYS[1]: the pin key   ARGV[1]: TTL in milliseconds
-- Returns the pin's JSON, or nil when no pin is in force.
local pin = redis.call('GET', KEYS[1])
if pin then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return pin
