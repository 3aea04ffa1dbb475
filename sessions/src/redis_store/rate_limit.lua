-- GCRA over several limits at once, all-or-nothing (see sessions/src/rate.rs for the formulas).
-- KEYS[i]: the counter of limit i (holds its theoretical arrival time, ms)
-- ARGV[3i-2], ARGV[3i-1], ARGV[3i]: period in ms, units per period, cost of limit i
-- ARGV[3n+1] (optional): "force" charges every limit whatever its budget (usage found out after
-- admission; a budget may go into debt); "refund" gives every limit its cost back (a request
-- refused after it was charged), never past a full budget, and returns {1}.
-- Returns {passed, then per limit: remaining, reset_after_ms, retry_after_ms (-1: none),
-- too_large (0/1)}. The server's clock is used, so every gateway agrees on "now".
-- Redis before 5 refuses writes after TIME unless the script replicates its effects (a
-- no-op from Redis 5 on).
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3 * #KEYS + 1] == 'refund' then
  for i = 1, #KEYS do
    local per = tonumber(ARGV[3 * i - 2]) / math.max(tonumber(ARGV[3 * i - 1]), 1)
    local tat = tonumber(redis.call('GET', KEYS[i]))
    if tat then
      local back = tat - per * tonumber(ARGV[3 * i])
      if back > now then
        redis.call('SET', KEYS[i], string.format('%.3f', back), 'PX', math.ceil(back - now))
      else
        redis.call('DEL', KEYS[i])
      end
    end
  end
  return {1}
end
local passed = 1
local out = {}
local new_tats = {}
local before = {}
for i = 1, #KEYS do
  local period = tonumber(ARGV[3 * i - 2])
  local limit = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local per = period / math.max(limit, 1)
  local tat = tonumber(redis.call('GET', KEYS[i]) or now) or now
  if tat < now then tat = now end
  local new_tat = tat + per * cost
  local allow_at = new_tat - period
  local remaining, reset_after, retry_after, too_large
  if cost > limit then
    passed = 0
    remaining = math.floor((now - (tat - period)) / per + 1e-6)
    reset_after = tat - now
    retry_after = -1
    too_large = 1
  elseif allow_at > now + 0.5 then
    -- (Half a millisecond: tat' - period is now for the budget's last unit only up to rounding,
    -- that of the floats and that of each tat stored to the microsecond, which adds up over a
    -- burst; now itself is whole milliseconds.)
    passed = 0
    remaining = math.floor((now - (tat - period)) / per + 1e-6)
    reset_after = tat - now
    retry_after = math.ceil(allow_at - now)
    too_large = 0
  else
    remaining = math.floor((now - allow_at) / per + 1e-6)
    reset_after = new_tat - now
    retry_after = -1
    too_large = 0
  end
  new_tats[i] = new_tat
  -- The figures with nothing charged, for a limit that lets the request through when another
  -- refuses it.
  before[i] = {math.floor((now - (tat - period)) / per + 1e-6), tat - now}
  out[#out + 1] = math.max(remaining, 0)
  out[#out + 1] = math.ceil(math.max(reset_after, 0))
  out[#out + 1] = retry_after
  out[#out + 1] = too_large
end
if ARGV[3 * #KEYS + 1] == 'force' then
  passed = 1
end
if passed == 1 then
  for i = 1, #KEYS do
    local ttl = math.ceil(new_tats[i] - now)
    if ttl > 0 then
      redis.call('SET', KEYS[i], string.format('%.3f', new_tats[i]), 'PX', ttl)
    end
  end
else
  for i = 1, #KEYS do
    if out[4 * i - 1] == -1 and out[4 * i] == 0 then
      out[4 * i - 3] = math.max(before[i][1], 0)
      out[4 * i - 2] = math.ceil(math.max(before[i][2], 0))
    end
  end
end
table.insert(out, 1, passed)
return out
