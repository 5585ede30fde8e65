-- Current usage of each meter. KEYS: per meter window hash, in-flight set, period hash.
-- ARGV: UTC day and month hints (meter.lua).
-- Returns per meter: requests, tokens, in flight, day tokens, month spend, requests and tokens of
-- the last ten seconds.
local out = {}
for i = 1, #KEYS / 3 do
  local m = read_meter(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], false)
  out[#out + 1] = m.r
  out[#out + 1] = m.t
  out[#out + 1] = m.fly
  out[#out + 1] = m.d
  out[#out + 1] = m.m
  out[#out + 1] = m.r10
  out[#out + 1] = m.t10
end
return out
