-- The lock a conversation's running turn holds (one key per team and conversation).
-- KEYS[1]: the lock   ARGV[1]: operation   ARGV[2]: owner (the holder's response id)
--   hold     ARGV[3]: TTL in milliseconds -> 1 taken or renewed (free, expired, or `owner`'s
--                                            already), 0 when another owner holds it
--   renew    ARGV[3]: TTL in milliseconds -> 1 renewed, 0 when `owner` does not hold it (it
--                                            is not taken again once released or expired)
--   release                               -> 1 released, 0 when `owner` did not hold it
local holder = redis.call('GET', KEYS[1])
if ARGV[1] == 'hold' then
  if holder == false or holder == ARGV[2] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
  end
  return 0
end
if ARGV[1] == 'renew' then
  if holder == ARGV[2] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 1
  end
  return 0
end
if holder == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
