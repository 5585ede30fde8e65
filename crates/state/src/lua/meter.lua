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

-- One meter's current usage; with `prune`, drops buckets that left the window.
local function read_meter(w, f, p, prune)
  local m = { r = 0, t = 0, rs = {}, ts = {} }
  local all = redis.call('HGETALL', w)
  for i = 1, #all, 2 do
    local field = all[i]
    local s = tonumber(string.sub(field, 2))
    if s == nil or s < oldest then
      if prune then redis.call('HDEL', w, field) end
    else
      local v = tonumber(all[i + 1])
      if string.sub(field, 1, 1) == 'r' then
        m.r = m.r + v
        m.rs[#m.rs + 1] = { s, v }
      else
        m.t = m.t + v
        m.ts[#m.ts + 1] = { s, v }
      end
    end
  end
  if prune then redis.call('ZREMRANGEBYSCORE', f, '-inf', now) end
  m.fly = redis.call('ZCOUNT', f, '(' .. now, '+inf')
  local pv = redis.call('HMGET', p, 'd' .. day, 'm' .. month)
  m.d = pv[1] and tonumber(pv[1]) or 0
  m.m = pv[2] and tonumber(pv[2]) or 0
  return m
end
