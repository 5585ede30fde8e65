-- Shared head of the scripts that pay debts (after meter.lua): what requests of one instance
-- still owe their meters, summed by the instance per meter and sent with its next admission under
-- the same hash tag, or on their own a few milliseconds later (the settlement queue, ledger.rs).
-- From ARGV[at] to the end, per meter: the meter (its keys are KEYS[3m-2..3m]), then five
-- lists, each its length first:
--   token corrections per bucket (second, delta); per UTC day (day, delta); spend corrections per
--   UTC month (month, delta); the in-flight members that ended; and counts made now (requests
--   0/1, tokens, in-flight member or '-', lease ms), a backend's quota meter.
-- A correction changes only a counter that is still live (a bucket in the window, the current
-- day or month) and never takes it below zero; the window's sums follow their bucket. An
-- admission folds the debts of its own meters into its reads and writes (`fold`).

-- One meter's debts from ARGV[i], and where the next meter's start.
local function read_debt(i)
  local d = { m = tonumber(ARGV[i]), buckets = {}, day = 0, month = 0 }
  i = i + 2
  for _ = 1, tonumber(ARGV[i - 1]) do
    local s = tonumber(ARGV[i])
    if s >= oldest then
      local b = { s, 't' .. ARGV[i], tonumber(ARGV[i + 1]), 0 }
      if s ~= second then
        d.fields = d.fields or {}
        d.fields[#d.fields + 1] = b[2]
        b[4] = 8 + #d.fields
      end
      d.buckets[#d.buckets + 1] = b
    end
    i = i + 2
  end
  i = i + 1
  for _ = 1, tonumber(ARGV[i - 1]) do
    if tonumber(ARGV[i]) == day then d.day = d.day + tonumber(ARGV[i + 1]) end
    i = i + 2
  end
  i = i + 1
  for _ = 1, tonumber(ARGV[i - 1]) do
    if tonumber(ARGV[i]) == month then d.month = d.month + tonumber(ARGV[i + 1]) end
    i = i + 2
  end
  d.ended, d.ended_at = tonumber(ARGV[i]), i + 1
  i = i + 1 + d.ended
  d.counts, d.counts_at = tonumber(ARGV[i]), i
  return d, i + 1 + 4 * d.counts
end

local function correct(key, field, delta)
  if redis.call('HINCRBY', key, field, delta) < 0 then redis.call('HSET', key, field, 0) end
end

-- Pays a debt's bucket corrections: one read, one write.
local function correct_window(w, d)
  if #d.buckets == 0 then return end
  local fields = { 'O', 'T', 'T10' }
  for k, b in ipairs(d.buckets) do fields[3 + k] = b[2] end
  local v = redis.call('HMGET', w, unpack(fields))
  local sums_at, total, recent = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  local out = {}
  for k, b in ipairs(d.buckets) do
    local before = tonumber(v[3 + k])
    if before then
      local after = math.max(before + b[3], 0)
      out[#out + 1] = b[2]
      out[#out + 1] = after
      if total then total = total + after - before end
      if recent and sums_at and b[1] >= sums_at + 49 then recent = recent + after - before end
    end
  end
  if #out == 0 then return end
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

-- Makes a debt's counts (from ARGV[i]) in the current second.
local function count_now(w, f, i)
  local n = tonumber(ARGV[i])
  if n == 0 then return end
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
end

-- Pays one meter's debt on its own.
local function pay_debt(d)
  local w, f, p = KEYS[3 * d.m - 2], KEYS[3 * d.m - 1], KEYS[3 * d.m]
  correct_window(w, d)
  if d.day ~= 0 then correct(p, day_field, d.day) end
  if d.month ~= 0 then correct(p, month_field, d.month) end
  if d.ended > 0 then redis.call('ZREM', f, unpack(ARGV, d.ended_at, d.ended_at + d.ended - 1)) end
  count_now(w, f, d.counts_at)
end

-- Reads every debt from ARGV[at]; pays at once those not among the first `own` meters (or that
-- count), and returns the others by meter, for the caller's reads to fold in.
local function pay_debts(at, own)
  local kept = {}
  local i = at
  while i <= #ARGV do
    local d
    d, i = read_debt(i)
    if d.m <= own and d.counts == 0 then kept[d.m] = d else pay_debt(d) end
  end
  return kept
end

-- Folds debt `d` into meter `m` just read with it (`read_meter`): the corrected counts are in
-- `m`, and the window's corrected buckets wait in `m.corrected` for the meter's next write.
local function fold(m, d)
  local corrected = {}
  for _, b in ipairs(d.buckets) do
    local before = tonumber(m.v[b[4] == 0 and 7 or b[4]])
    if before then
      local after = math.max(before + b[3], 0)
      local moved = after - before
      if b[4] == 0 then
        m.tb = after
      else
        corrected[#corrected + 1] = b[2]
        corrected[#corrected + 1] = after
      end
      m.t = math.max(m.t + moved, 0)
      if b[1] >= recent_from then m.t10 = math.max(m.t10 + moved, 0) end
      m.window_owed = true
    end
  end
  if #corrected > 0 then m.corrected = corrected end
  if d.day ~= 0 then m.d, m.period_owed = math.max(m.d + d.day, 0), true end
  if d.month ~= 0 then m.m, m.period_owed = math.max(m.m + d.month, 0), true end
end

-- Writes what `fold` changed in a meter that is not charged after all (a refused admission).
local function write_folded(w, p, m)
  if m.window_owed then
    local args = { t_now, m.tb, 'T', m.t, 'T10', m.t10 }
    for k = 1, #(m.corrected or {}) do args[#args + 1] = m.corrected[k] end
    redis.call('HSET', w, unpack(args))
  end
  if m.period_owed then redis.call('HSET', p, day_field, m.d, month_field, m.m) end
end
