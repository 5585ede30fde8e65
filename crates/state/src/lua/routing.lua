-- Everything one routing decision reads, in one round trip.
-- KEYS: the targets' hash (not-served, cooldown and served entries: `n`, `c` or `s`, then the
-- target's field); then per backend: breaker record, meter window, meter in-flight set; then,
-- when any target has a breaker, each target's breaker record.
-- ARGV: target count N, per target its three fields (n, c, s), then per backend two flags ("10":
-- breaker, not metered).
-- Returns per target: not-served ms left (-1 none), cooldown ms left (-1 none), served (0/1);
-- per backend: breaker phase (0 closed, 1 open, 2 half-open, 3 half-open probing), open ms left,
-- requests and tokens in the rolling minute, in flight, requests and tokens of the last ten
-- seconds (the last five -1 when not metered); then, when the target breakers were given, per
-- target its breaker phase and open ms left.
local n = tonumber(ARGV[1])
local out = {}
local function breaker_phase(key)
  local v = redis.call('HMGET', key, 'o', 'p')
  local o = v[1] and tonumber(v[1]) or 0
  local p = v[2] and tonumber(v[2]) or 0
  if o == 0 then return 0, 0
  elseif now < o then return 1, o - now
  elseif p > now then return 3, 0 end
  return 2, 0
end
if n > 0 then
  local v = redis.call('HMGET', KEYS[1], unpack(ARGV, 2, 1 + 3 * n))
  for i = 1, n do
    local a = tonumber(v[3 * i - 2]) or 0
    local b = tonumber(v[3 * i - 1]) or 0
    local c = tonumber(v[3 * i]) or 0
    out[#out + 1] = a > now and a - now or -1
    out[#out + 1] = b > now and b - now or -1
    out[#out + 1] = c > now and 1 or 0
  end
end
local backends = #ARGV - 1 - 3 * n
for j = 1, backends do
  local flags = ARGV[1 + 3 * n + j]
  local phase, left = 0, 0
  if string.sub(flags, 1, 1) == '1' then
    phase, left = breaker_phase(KEYS[3 * j - 1])
  end
  out[#out + 1] = phase
  out[#out + 1] = left
  if string.sub(flags, 2, 2) == '1' then
    local m = window(KEYS[3 * j], true)
    out[#out + 1] = m.r
    out[#out + 1] = m.t
    out[#out + 1] = redis.call('ZCOUNT', KEYS[3 * j + 1], '(' .. now, '+inf')
    out[#out + 1] = m.r10
    out[#out + 1] = m.t10
  else
    for _ = 1, 5 do out[#out + 1] = -1 end
  end
end
if #KEYS > 1 + 3 * backends then
  for i = 1, n do
    local phase, left = breaker_phase(KEYS[1 + 3 * backends + i])
    out[#out + 1] = phase
    out[#out + 1] = left
  end
end
return out
