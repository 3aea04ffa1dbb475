-- Append one gateway's entries to a pool's feed and read the others' past a cursor.
-- KEYS[1]: the feed (a list of "<number> <gateway> <entry>")
-- KEYS[2]: the number of its last entry
-- ARGV[1]: this gateway's id   ARGV[2]: the cursor (-1: start at the end)
-- ARGV[3]: entries kept        ARGV[4..]: this gateway's entries, in order
-- Returns {cursor, skipped, gateway, entry, gateway, entry, ...}: the others' entries past
-- the cursor, oldest first, and how many past it were trimmed before this read. A cursor
-- past the end (the feed expired and started again) starts at the end. Both keys expire ten
-- minutes after the last append.
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local keep = tonumber(ARGV[3])
if #ARGV >= 4 then
  for i = 4, #ARGV do
    last = last + 1
    redis.call('RPUSH', KEYS[1], last .. ' ' .. ARGV[1] .. ' ' .. ARGV[i])
  end
  redis.call('LTRIM', KEYS[1], -keep, -1)
  redis.call('SET', KEYS[2], last, 'PX', 600000)
  redis.call('PEXPIRE', KEYS[1], 600000)
end
local cursor = tonumber(ARGV[2])
if cursor < 0 or cursor >= last then
  return {tostring(last), '0'}
end
local held = redis.call('LLEN', KEYS[1])
local first = last - held + 1
local from = math.max(cursor + 1, first)
local out = {tostring(last), tostring(from - (cursor + 1))}
local items = redis.call('LRANGE', KEYS[1], from - first, -1)
-- Each item is checked against the cursor by its own number, so a list that outlived its
-- number key (or the other way round) never passes off old entries as new.
for _, item in ipairs(items) do
  local space = string.find(item, ' ', 1, true)
  local rest = string.sub(item, space + 1)
  local gap = string.find(rest, ' ', 1, true)
  local by = string.sub(rest, 1, gap - 1)
  if tonumber(string.sub(item, 1, space - 1)) > cursor and by ~= ARGV[1] then
    out[#out + 1] = by
    out[#out + 1] = string.sub(rest, gap + 1)
  end
end
return out
