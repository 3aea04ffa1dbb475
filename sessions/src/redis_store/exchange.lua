-- Publish one gateway's state on a pool's exchange board and read the others'.
-- KEYS[1]: the board (a hash: gateway id -> "<published at, ms of Redis time> <state>")
-- ARGV[1]: this gateway's id   ARGV[2]: its state (opaque)
-- ARGV[3]: age in ms past which another gateway's state is not returned
-- Returns a flat array: for every other gateway with a fresh state, its age in ms, then the
-- state. Ages use Redis's clock only, so the gateways' clocks need not agree. A state ten
-- minutes old (its gateway is gone: intervals are at most a minute) is removed; the hash
-- expires when no gateway has written for ten minutes.
-- Redis before 5 refuses writes after TIME unless the script replicates its effects (a
-- no-op from Redis 5 on).
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
local forget = 600000
redis.call('PEXPIRE', KEYS[1], forget)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local value = all[i + 1]
    local space = string.find(value, ' ', 1, true)
    local at = space and tonumber(string.sub(value, 1, space - 1))
    if at and now - at <= stale then
      out[#out + 1] = tostring(math.max(0, now - at))
      out[#out + 1] = string.sub(value, space + 1)
    elseif not at or now - at > forget then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
return out
