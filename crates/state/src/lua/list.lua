-- The live entries of a not-served or cooldown hash as {field, ms left, ...}; drops the rest.
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local until_ms = tonumber(all[i + 1])
  if until_ms <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = tostring(until_ms - now)
  end
end
return out
