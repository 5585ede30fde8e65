-- Counts tokens and spend used without a reservation (a realtime session's responses) where they
-- fall now: in the rolling minute, the UTC day and the UTC month; no request, nothing in flight.
-- KEYS: per meter window hash, in-flight set, period hash. ARGV: UTC day and month hints
-- (meter.lua), tokens, millionths of a dollar.
-- Returns per meter: requests, tokens, in flight, day tokens, month spend, requests and tokens of
-- the last ten seconds, after the charge.
local tokens, usd = tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i = 1, #KEYS / 3 do
  local w, f, p = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local m = read_meter(w, f, p, true)
  count_in_window(w, m, 0, tokens)
  charge_period(p, m, tokens, usd)
  out[#out + 1] = m.r
  out[#out + 1] = m.t
  out[#out + 1] = m.fly
  out[#out + 1] = m.d
  out[#out + 1] = m.m
  out[#out + 1] = m.r10
  out[#out + 1] = m.t10
end
return out
