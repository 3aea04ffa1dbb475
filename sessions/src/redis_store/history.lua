-- Load the item history of the chain ending at KEYS[1], oldest first, in one call.
-- KEYS[1]: hash of the newest response
-- ARGV[1]: team that must own every response walked
-- ARGV[2]: key prefix of response hashes (predecessor key = ARGV[2] .. prev)
-- ARGV[3]: TTL in milliseconds, refreshed on every response walked (see `refresh`)
-- ARGV[4]: longest chain accepted; longer means a cycle
-- ARGV[5]: id of the newest response (KEYS[1] without the prefix)
-- ARGV[6]: key prefix of deletion markers (marker key = ARGV[6] .. id; see delete.lua)
-- Returns nil if KEYS[1] is missing or another team's; otherwise the id of the oldest response
-- walked (the chain's root), the status of KEYS[1]'s response, then the JSON blobs [input_1,
-- output_1, ..., input_n, output_n]. The walk stops at the first predecessor that was deleted
-- or is owned by another team. A predecessor that is missing without a deletion marker was
-- lost (evicted under maxmemory, expired, or gone with a Redis restart): the answer is then
-- {'!lost', its id}, since a history without it would be silently cut short. A chain longer than
-- ARGV[4] answers {'!cycle', ARGV[4]}.
local team = ARGV[1]
local prefix = ARGV[2]
local ttl = ARGV[3]
local max_len = tonumber(ARGV[4])
local deleted_prefix = ARGV[6]

-- A key's TTL is set again only when more than a 64th of it has passed since it was last set: a
-- session's turns, seconds apart, rewrite each key of the chain once, not once per turn (each
-- PEXPIRE that changes a TTL is a write that goes to the replicas and the AOF), and a chain
-- still lives at least 63/64 of the TTL after its last use. Answers whether the key exists.
local fresh = tonumber(ttl) - math.floor(tonumber(ttl) / 64)
local function refresh(k)
  local left = redis.call('PTTL', k)
  if left == -2 then
    return false
  end
  if left == -1 or left < fresh then
    redis.call('PEXPIRE', k, ttl)
  end
  return true
end

local key = KEYS[1]
local root = ARGV[5]
local fields = redis.call('HMGET', key, 'team', 'prev', 'input', 'output', 'status')
if fields[1] ~= team then
  return false
end
local status = fields[5] or ''

local reversed = {}
local walked = 0
while true do
  walked = walked + 1
  if walked > max_len then
    return {'!cycle', tostring(max_len)}
  end
  reversed[#reversed + 1] = fields[4]
  reversed[#reversed + 1] = fields[3]
  refresh(key)
  local prev = fields[2]
  if not prev or prev == '' then
    break
  end
  key = prefix .. prev
  fields = redis.call('HMGET', key, 'team', 'prev', 'input', 'output')
  if not fields[1] then
    -- A deleted predecessor is where the history starts for as long as the chain lives: its
    -- marker is refreshed with the chain.
    if not refresh(deleted_prefix .. prev) then
      return {'!lost', prev}
    end
    break
  end
  if fields[1] ~= team then
    break
  end
  root = prev
end

local blobs = {root, status}
for i = #reversed, 1, -1 do
  blobs[#blobs + 1] = reversed[i]
end
return blobs
