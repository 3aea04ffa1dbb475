-- Set a session pin only if the pin in force equals the expected one; refresh its TTL either way.
-- KEYS[1]: the pin key
-- ARGV[1]: expected pin as JSON {"endpoint":..,"moves":..}, or '' for "no pin yet"
-- ARGV[2]: new pin as JSON        ARGV[3]: TTL in milliseconds
-- Returns {applied, pin}: 1 and ARGV[2] if it applied, else 0 and the JSON of the pin in force.
-- Pins compare by their fields, not their bytes. With no pin in force (never set, expired, or
-- unreadable) the new pin applies whatever was expected.
local current = redis.call('GET', KEYS[1])
if current then
  local ok, pin = pcall(cjson.decode, current)
  -- A pin without both fields (another version's, a corrupted one) is unreadable to the
  -- gateway too: replaced, not kept alive.
  -- (As the gateway reads a pin: moves a u32, url absent, null or a string.)
  if ok and type(pin) == 'table' and type(pin.endpoint) == 'string'
      and type(pin.moves) == 'number' and pin.moves >= 0 and pin.moves < 4294967296
      and pin.moves == math.floor(pin.moves)
      and (pin.url == nil or pin.url == cjson.null or type(pin.url) == 'string') then
    local same = false
    if ARGV[1] ~= '' then
      local expected = cjson.decode(ARGV[1])
      same = pin.endpoint == expected.endpoint and pin.moves == expected.moves
    end
    if not same then
      redis.call('PEXPIRE', KEYS[1], ARGV[3])
      return {0, current}
    end
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, ARGV[2]}
