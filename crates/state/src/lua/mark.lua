-- Teaches the not-served cache, the served marks or the cooldowns.
-- KEYS[1]: the hash to write; KEYS[2]: the not-served hash (a served mark clears its entry).
-- ARGV: operation (set, extend, served), field, ms from now.
local field = ARGV[2]
local until_ms = now + tonumber(ARGV[3])
if ARGV[1] == 'extend' then
  local current = redis.call('HGET', KEYS[1], field)
  if not current or tonumber(current) < until_ms then redis.call('HSET', KEYS[1], field, until_ms) end
else
  redis.call('HSET', KEYS[1], field, until_ms)
end
if ARGV[1] == 'served' then redis.call('HDEL', KEYS[2], field) end
if redis.call('HLEN', KEYS[1]) > 512 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if tonumber(all[i + 1]) <= now then redis.call('HDEL', KEYS[1], all[i]) end
  end
end
return 1
