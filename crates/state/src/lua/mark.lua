-- Teaches the not-served cache, the served marks or the cooldowns: entries of the targets' hash
-- (KEYS[1]), each field a kind letter (`n`, `s`, `c`) and the target's field, holding when it
-- ends. ARGV: operation (set, extend, served), the entry's field, ms from now; for served, the
-- not-served field it clears.
local field = ARGV[2]
local until_ms = now + tonumber(ARGV[3])
if ARGV[1] == 'extend' then
  local current = redis.call('HGET', KEYS[1], field)
  if not current or tonumber(current) < until_ms then redis.call('HSET', KEYS[1], field, until_ms) end
else
  redis.call('HSET', KEYS[1], field, until_ms)
end
if ARGV[1] == 'served' then redis.call('HDEL', KEYS[1], ARGV[4]) end
if redis.call('HLEN', KEYS[1]) > 1536 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if tonumber(all[i + 1]) <= now then redis.call('HDEL', KEYS[1], all[i]) end
  end
end
return 1
