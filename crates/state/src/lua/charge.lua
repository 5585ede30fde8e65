-- Counts tokens and spend used without a reservation (a realtime session's responses) where they
-- fall now: in the rolling minute, the UTC day and the UTC month; no request, nothing in flight.
-- KEYS: per meter window hash, in-flight set, period hash. ARGV: tokens, millionths of a dollar.
-- Returns per meter: requests, tokens, in flight, day tokens, month spend, requests and tokens of
-- the last ten seconds, after the charge.
local tokens, usd = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS / 3 do
  local w, f, p = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local m = read_meter(w, f, p, true)
  redis.call('HINCRBY', w, 't' .. second, tokens)
  redis.call('HINCRBY', w, 'T', tokens)
  redis.call('PEXPIRE', w, 61000)
  local day_total, month_total = charge_period(p, tokens, usd)
  out[#out + 1] = m.r
  out[#out + 1] = m.t + tokens
  out[#out + 1] = m.fly
  out[#out + 1] = day_total
  out[#out + 1] = month_total
  out[#out + 1] = m.r10
  out[#out + 1] = m.t10 + tokens
end
return out
