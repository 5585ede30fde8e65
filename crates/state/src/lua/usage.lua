-- Current usage of each meter. KEYS: per meter window hash, in-flight set, period hash.
-- Returns per meter: requests, tokens, in flight, day tokens, month spend.
local out = {}
for i = 1, #KEYS / 3 do
  local m = read_meter(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], false)
  out[#out + 1] = m.r
  out[#out + 1] = m.t
  out[#out + 1] = m.fly
  out[#out + 1] = m.d
  out[#out + 1] = m.m
end
return out
