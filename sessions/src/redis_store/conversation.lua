-- Conversations API: one script, the operation in ARGV[1], so every operation checks the owner
-- and refreshes the TTL of both keys atomically.
-- KEYS[1]: hash of the conversation (team, created_at, metadata, joined:<response id>...)
-- KEYS[2]: list of its items
-- ARGV[1]: operation   ARGV[2]: team that must own it   ARGV[3]: TTL in milliseconds
--   get                                  -> {created_at, metadata}, or nil when not the team's
--   metadata    ARGV[4]: metadata JSON   -> created_at, or nil
--   delete                               -> 1 deleted, 0 when not the team's
--   items                                -> every item, oldest first, or nil
--   len                                  -> how many items it holds, or nil
--   append      ARGV[4]: response id whose items these are ("" for none), ARGV[5..]: items
--                                        -> 1 (also when that response's items are already
--                                           there), or 0 when not the team's
--   delete_item ARGV[4]: item id         -> 1 removed, 0 no such item, -1 when not the team's
local op = ARGV[1]
if redis.call('HGET', KEYS[1], 'team') ~= ARGV[2] then
  if op == 'delete_item' then return -1 end
  if op == 'get' or op == 'metadata' or op == 'items' or op == 'len' then return false end
  return 0
end
if op == 'delete' then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if op == 'get' then
  return redis.call('HMGET', KEYS[1], 'created_at', 'metadata')
elseif op == 'metadata' then
  redis.call('HSET', KEYS[1], 'metadata', ARGV[4])
  return redis.call('HGET', KEYS[1], 'created_at')
elseif op == 'items' then
  return redis.call('LRANGE', KEYS[2], 0, -1)
elseif op == 'len' then
  return redis.call('LLEN', KEYS[2])
elseif op == 'append' then
  -- A retried write whose first try landed adds nothing twice.
  if ARGV[4] ~= '' and redis.call('HEXISTS', KEYS[1], 'joined:' .. ARGV[4]) == 1 then
    return 1
  end
  -- In slices: Lua's unpack has a limit on how many values it returns.
  for first = 5, #ARGV, 1000 do
    redis.call('RPUSH', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  -- Marked last, so a write that stopped part way is not taken for one that landed.
  if ARGV[4] ~= '' then
    redis.call('HSET', KEYS[1], 'joined:' .. ARGV[4], 1)
  end
  return 1
elseif op == 'delete_item' then
  for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    local ok, decoded = pcall(cjson.decode, item)
    if ok and type(decoded) == 'table' and decoded['id'] == ARGV[4] then
      redis.call('LREM', KEYS[2], 1, item)
      return 1
    end
  end
  return 0
end
return redis.error_reply('unknown conversation operation ' .. op)
