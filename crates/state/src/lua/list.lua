-- The live entries of one kind (ARGV[1]: `n` not-served, `c` cooldown) of the targets' hash
-- (KEYS[1]) as {target field, ms left, ...}; drops the expired entries of every kind.
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local until_ms = tonumber(all[i + 1])
  if until_ms <= now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif string.sub(all[i], 1, 1) == ARGV[1] then
    out[#out + 1] = string.sub(all[i], 2)
    out[#out + 1] = tostring(until_ms - now)
  end
end
return out
