-- Replaces a reservation's charge with the final numbers, where its buckets still exist.
-- KEYS: per meter window hash, in-flight set, period hash.
-- ARGV: second, day, month, token delta, spend delta, member, release (0/1).
local second, day, month = ARGV[1], ARGV[2], ARGV[3]
local dt, du = tonumber(ARGV[4]), tonumber(ARGV[5])
local function adjust(key, field, delta)
  if delta ~= 0 and redis.call('HEXISTS', key, field) == 1 then
    if redis.call('HINCRBY', key, field, delta) < 0 then redis.call('HSET', key, field, 0) end
  end
end
for i = 1, #KEYS / 3 do
  adjust(KEYS[3 * i - 2], 't' .. second, dt)
  adjust(KEYS[3 * i], 'd' .. day, dt)
  adjust(KEYS[3 * i], 'm' .. month, du)
  if ARGV[7] == '1' then redis.call('ZREM', KEYS[3 * i - 1], ARGV[6]) end
end
return 1
