-- Shared head of the meter scripts: UTC calendar arithmetic (Howard Hinnant's civil_from_days /
-- days_from_civil, as in meter.rs) and reading one meter.
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
local second = math.floor(now / 1000)
local oldest = second - 59
local day = math.floor(now / 86400000)
local year, mon = civil(day)
local month = year * 12 + mon - 1
local function month_ends_in()
  local next = month + 1
  return days_from_civil(math.floor(next / 12), next % 12 + 1, 1) * 86400000 - now
end

-- A meter's window is one hash: per-second buckets `r<second>` and `t<second>` (requests, tokens),
-- and their running sums `R` and `T`, exact for the buckets at or after `O`. While no bucket can
-- have left the window since (`O` is still the oldest second), the sums are read as they are;
-- otherwise the buckets are summed again (and, with `prune`, the stale ones dropped): once a
-- second per meter at most.
local function window(w, prune)
  local v = redis.call('HMGET', w, 'R', 'T', 'O')
  if v[3] and tonumber(v[3]) >= oldest then
    return tonumber(v[1]) or 0, tonumber(v[2]) or 0
  end
  local r, t = 0, 0
  local all = redis.call('HGETALL', w)
  for i = 1, #all, 2 do
    local field = all[i]
    local kind = string.sub(field, 1, 1)
    if kind == 'r' or kind == 't' then
      local s = tonumber(string.sub(field, 2))
      if s == nil or s < oldest then
        if prune then redis.call('HDEL', w, field) end
      elseif kind == 'r' then
        r = r + tonumber(all[i + 1])
      else
        t = t + tonumber(all[i + 1])
      end
    end
  end
  if prune then redis.call('HSET', w, 'R', r, 'T', t, 'O', oldest) end
  return r, t
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

-- One meter's current usage; with `prune`, drops what left the window or its lease.
local function read_meter(w, f, p, prune)
  local m = {}
  m.r, m.t = window(w, prune)
  m.r10, m.t10 = recent(w)
  if prune then redis.call('ZREMRANGEBYSCORE', f, '-inf', now) end
  m.fly = redis.call('ZCOUNT', f, '(' .. now, '+inf')
  local pv = redis.call('HMGET', p, 'd' .. day, 'm' .. month)
  m.d = pv[1] and tonumber(pv[1]) or 0
  m.m = pv[2] and tonumber(pv[2]) or 0
  return m
end

-- Adds tokens to the UTC day and millionths of a dollar to the UTC month of period hash p, and
-- returns the two totals. A period's first charge: the ones before it are over.
local function charge_period(p, tokens, usd)
  local df, mf = 'd' .. day, 'm' .. month
  local day_total = redis.call('HINCRBY', p, df, tokens)
  local month_total = redis.call('HINCRBY', p, mf, usd)
  if day_total == tokens or month_total == usd then
    for _, k in ipairs(redis.call('HKEYS', p)) do
      if k ~= df and k ~= mf then redis.call('HDEL', p, k) end
    end
  end
  redis.call('PEXPIRE', p, 35 * 86400000)
  return day_total, month_total
end
