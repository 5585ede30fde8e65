-- Replaces a reservation's charge with the final numbers, where its buckets still exist.
-- KEYS: per meter window hash, in-flight set, period hash.
-- ARGV: second, day, month, token delta, spend delta, member, release (0/1).
local second, day, month = ARGV[1], ARGV[2], ARGV[3]
local dt, du = tonumber(ARGV[4]), tonumber(ARGV[5])
-- Changes a counter by `delta` (never below zero) if it exists; returns the change made.
local function adjust(key, field, delta)
  if delta == 0 then return 0 end
  local before = redis.call('HGET', key, field)
  if not before then return 0 end
  before = tonumber(before)
  local after = math.max(before + delta, 0)
  redis.call('HSET', key, field, after)
  return after - before
end
for i = 1, #KEYS / 3 do
  local w = KEYS[3 * i - 2]
  -- The window's running sum follows its bucket (a pruned bucket is out of both).
  local moved = adjust(w, 't' .. second, dt)
  if moved ~= 0 then adjust(w, 'T', moved) end
  adjust(KEYS[3 * i], 'd' .. day, dt)
  adjust(KEYS[3 * i], 'm' .. month, du)
  if ARGV[7] == '1' then redis.call('ZREM', KEYS[3 * i - 1], ARGV[6]) end
end
return 1
