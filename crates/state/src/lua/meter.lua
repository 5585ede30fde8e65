-- Shared head of the meter scripts (after window.lua; their own arguments start at ARGV[3]): UTC calendar arithmetic (Howard Hinnant's
-- civil_from_days / days_from_civil, as in meter.rs), reading one meter and charging its periods.
local function civil(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local mo = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if mo <= 2 then y = y + 1 end
  return y, mo
end
local function days_from_civil(y, mo, d)
  if mo <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = mo > 2 and mo - 3 or mo + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
-- ARGV[1] and ARGV[2] are the UTC day and month by the caller's clock: when its day is Redis's,
-- they are taken as they are (no calendar arithmetic, no number to format); otherwise (around
-- midnight, with clocks that drift) they are worked out here.
local day = math.floor(now / 86400000)
local month, day_field, month_field
if tonumber(ARGV[1]) == day then
  month = tonumber(ARGV[2])
  day_field, month_field = 'd' .. ARGV[1], 'm' .. ARGV[2]
else
  local year, mon = civil(day)
  month = year * 12 + mon - 1
  day_field, month_field = 'd' .. day, 'm' .. month
end
local function month_ends_in()
  local next = month + 1
  return days_from_civil(math.floor(next / 12), next % 12 + 1, 1) * 86400000 - now
end

-- The live buckets of one kind ('r' or 't') as {second, count}, oldest first (for retry-after).
local function buckets(w, kind)
  local list = {}
  local all = redis.call('HGETALL', w)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 1) == kind then
      local s = tonumber(string.sub(all[i], 2))
      if s and s >= oldest then list[#list + 1] = { s, tonumber(all[i + 1]) } end
    end
  end
  table.sort(list, function(a, b) return a[1] < b[1] end)
  return list
end

-- One meter's current usage (the window's table, with in flight, day tokens and month spend);
-- with `prune`, drops what left the window or its lease (the leases once a second, with the
-- window: ZCOUNT counts only the live ones anyway). With `debt` (debts.lua), also reads the
-- buckets it corrects and first ends its requests in flight.
local function read_meter(w, f, p, prune, debt)
  local m = window(w, prune, debt and debt.fields)
  if prune and m.summed then redis.call('ZREMRANGEBYSCORE', f, '-inf', now) end
  if debt and debt.ended > 0 then
    redis.call('ZREM', f, unpack(ARGV, debt.ended_at, debt.ended_at + debt.ended - 1))
  end
  m.fly = redis.call('ZCOUNT', f, '(' .. now, '+inf')
  local pv = redis.call('HMGET', p, day_field, month_field)
  m.d = tonumber(pv[1]) or 0
  m.m = tonumber(pv[2]) or 0
  m.new_period = not (pv[1] and pv[2])
  return m
end

-- Adds tokens to the UTC day and millionths of a dollar to the UTC month of period hash p (read
-- into `m` by `read_meter` in this call). A period's first charge: the periods before it are
-- over, and the hash lives 35 days from here.
local function charge_period(p, m, tokens, usd)
  m.d, m.m = m.d + tokens, m.m + usd
  redis.call('HSET', p, day_field, m.d, month_field, m.m)
  if m.new_period then
    for _, k in ipairs(redis.call('HKEYS', p)) do
      if k ~= day_field and k ~= month_field then redis.call('HDEL', p, k) end
    end
    redis.call('PEXPIRE', p, 35 * 86400000)
    m.new_period = false
  end
end
