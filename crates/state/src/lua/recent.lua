-- The short window, shared by the meter and routing scripts: the requests and tokens of the
-- current second's buckets and the ten before (as meter.rs's `Window::recent`). Its fields are
-- named once a script.
local recent_fields = {}
for s = math.floor(now / 1000) - 10, math.floor(now / 1000) do
  recent_fields[#recent_fields + 1] = 'r' .. s
  recent_fields[#recent_fields + 1] = 't' .. s
end
local function recent(w)
  local v = redis.call('HMGET', w, unpack(recent_fields))
  local r, t = 0, 0
  for i = 1, #v, 2 do
    r = r + (tonumber(v[i]) or 0)
    t = t + (tonumber(v[i + 1]) or 0)
  end
  return r, t
end
