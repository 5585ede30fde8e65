-- Shared head of the scripts that pay debts (after window.lua): what requests of one instance
-- still owe their meters, summed by the instance per meter and sent with its next admission under
-- the same hash tag, or on their own a few milliseconds later (the settlement queue, ledger.rs).
-- From ARGV[at] to the end, per meter: the meter (its keys are KEYS[3m-2..3m]), then five
-- lists, each its length first:
--   token corrections per bucket (second, delta); per UTC day (day, delta); spend corrections per
--   UTC month (month, delta); the in-flight members that ended; and counts made now (requests
--   0/1, tokens, in-flight member or '-', lease ms), a backend's quota meter.
-- A correction changes only a counter that is still live (a bucket in the window, the current
-- day or month) and never takes it below zero; the window's sums follow their bucket.
local function correct(key, field, delta)
  if redis.call('HINCRBY', key, field, delta) < 0 then redis.call('HSET', key, field, 0) end
end

-- Pays the bucket corrections that start at ARGV[i] (one read, one write); returns where the
-- next list starts.
local function correct_window(w, i)
  local n = tonumber(ARGV[i])
  if n == 0 then return i + 1 end
  local fields = { 'O', 'T', 'T10' }
  for k = 1, n do fields[3 + k] = 't' .. ARGV[i + 2 * k - 1] end
  local v = redis.call('HMGET', w, unpack(fields))
  local sums_at, total, recent = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  local out = {}
  for k = 1, n do
    local s, before = tonumber(ARGV[i + 2 * k - 1]), tonumber(v[3 + k])
    if s >= oldest and before then
      local after = math.max(before + tonumber(ARGV[i + 2 * k]), 0)
      out[#out + 1] = fields[3 + k]
      out[#out + 1] = after
      if total then total = total + after - before end
      if recent and sums_at and s >= sums_at + 49 then recent = recent + after - before end
    end
  end
  if #out > 0 then
    if total then
      out[#out + 1] = 'T'
      out[#out + 1] = math.max(total, 0)
    end
    if recent then
      out[#out + 1] = 'T10'
      out[#out + 1] = math.max(recent, 0)
    end
    redis.call('HSET', w, unpack(out))
  end
  return i + 2 * n + 1
end

-- Pays the corrections of one period (the current one is `current`, its field `field`).
local function correct_period(p, i, current, field)
  for _ = 1, tonumber(ARGV[i]) do
    if tonumber(ARGV[i + 1]) == current then correct(p, field, ARGV[i + 2]) end
    i = i + 2
  end
  return i + 1
end

local function count_now(w, f, i)
  local n = tonumber(ARGV[i])
  if n == 0 then return i + 1 end
  local requests, tokens, flying, lease = 0, 0, {}, 0
  for _ = 1, n do
    requests = requests + tonumber(ARGV[i + 1])
    tokens = tokens + tonumber(ARGV[i + 2])
    if ARGV[i + 3] ~= '-' then
      local ms = tonumber(ARGV[i + 4])
      flying[#flying + 1] = now + ms
      flying[#flying + 1] = ARGV[i + 3]
      if ms > lease then lease = ms end
    end
    i = i + 4
  end
  local m = window(w, true)
  if #flying > 0 then
    redis.call('ZADD', f, unpack(flying))
    count_in_window(w, m, requests, tokens, lease_to(f, m, now + lease + 1000))
  else
    count_in_window(w, m, requests, tokens)
  end
  return i + 1
end

local function pay_debts(at)
  local i = at
  while i <= #ARGV do
    local m = tonumber(ARGV[i])
    local w, f, p = KEYS[3 * m - 2], KEYS[3 * m - 1], KEYS[3 * m]
    i = correct_window(w, i + 1)
    i = correct_period(p, i, day, day_field)
    i = correct_period(p, i, month, month_field)
    local ended = tonumber(ARGV[i])
    if ended > 0 then redis.call('ZREM', f, unpack(ARGV, i + 1, i + ended)) end
    i = count_now(w, f, i + 1 + ended)
  end
end
