-- Append one gateway's entries to a pool's feed and read the others' past a cursor.
-- KEYS[1]: the feed (a list of "<number> <gateway> <entry>")
-- KEYS[2]: the number of its last entry
-- ARGV[1]: this gateway's id   ARGV[2]: the cursor (-1: none, read from the oldest kept)
-- ARGV[3]: entries kept        ARGV[4]: most entries read (the reader's own included)
-- ARGV[5..]: this gateway's entries, in order
-- Returns {cursor, skipped, gateway, entry, gateway, entry, ...}: the others' entries among
-- the (at most ARGV[4]) next past the cursor, oldest first, the number of the last of those
-- read (the next call's cursor), and how many past the cursor were trimmed before this read.
-- A cursor past the end (the feed expired and started again) reads from the oldest kept.
-- Both keys expire ten minutes after the last append.
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local keep = tonumber(ARGV[3])
local most = tonumber(ARGV[4])
if #ARGV >= 5 then
  for i = 5, #ARGV do
    last = last + 1
    redis.call('RPUSH', KEYS[1], last .. ' ' .. ARGV[1] .. ' ' .. ARGV[i])
  end
  redis.call('LTRIM', KEYS[1], -keep, -1)
  redis.call('SET', KEYS[2], last, 'PX', 600000)
  redis.call('PEXPIRE', KEYS[1], 600000)
end
local cursor = tonumber(ARGV[2])
local counted = cursor >= 0 and cursor <= last
if not counted then
  cursor = 0
end
local held = redis.call('LLEN', KEYS[1])
local first = last - held + 1
local from = math.max(cursor + 1, first)
local skipped = 0
if counted then
  skipped = from - (cursor + 1)
end
local out = {tostring(cursor), tostring(skipped)}
if from > last then
  -- Nothing past the cursor is kept: nothing to read up to the end.
  out[1] = tostring(last)
  return out
end
local items = redis.call('LRANGE', KEYS[1], from - first, from - first + most - 1)
-- Each item is checked against the cursor by its own number, so a list that outlived its
-- number key (or the other way round) never passes off old entries as new.
for _, item in ipairs(items) do
  local space = string.find(item, ' ', 1, true)
  local number = tonumber(string.sub(item, 1, space - 1))
  local rest = string.sub(item, space + 1)
  local gap = string.find(rest, ' ', 1, true)
  local by = string.sub(rest, 1, gap - 1)
  if number > cursor then
    out[1] = tostring(number)
    if by ~= ARGV[1] then
      out[#out + 1] = by
      out[#out + 1] = string.sub(rest, gap + 1)
    end
  end
end
return out
