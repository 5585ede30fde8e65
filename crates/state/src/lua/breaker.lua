-- A breaker record's transitions, as in breaker.rs. KEYS[1]: the record.
-- ARGV: operation (read, trip, reopen, claim, close, release), then its numbers:
-- trip WAIT_MS; reopen BASE_MS FACTOR MAX_MS (Backoff::wait in breaker.rs); claim LEASE_MS.
-- Returns {phase (0 closed, 1 open, 2 half-open, 3 half-open probing), open ms left, reopens,
-- trips, 1 when this call got the probe}.
local v = redis.call('HMGET', KEYS[1], 'o', 'p', 'r', 'n')
local o = v[1] and tonumber(v[1]) or 0
local p = v[2] and tonumber(v[2]) or 0
local r = v[3] and tonumber(v[3]) or 0
local n = v[4] and tonumber(v[4]) or 0
local function phase()
  if o == 0 then return 0, 0 end
  if now < o then return 1, o - now end
  if p > now then return 3, 0 end
  return 2, 0
end
local op = ARGV[1]
local code = phase()
local changed, probe = false, 0
if op == 'trip' and code == 0 then
  o, p, r, n = now + math.max(tonumber(ARGV[2]), 1), 0, 0, n + 1
  changed = true
elseif op == 'reopen' and code >= 2 then
  r = r + 1
  local base = tonumber(ARGV[2])
  local grown = base * math.max(tonumber(ARGV[3]), 1) ^ r
  local wait = math.max(math.floor(math.min(grown, tonumber(ARGV[4]))), base)
  o, p, n = now + math.max(wait, 1), 0, n + 1
  changed = true
elseif op == 'claim' and code == 2 then
  p = now + math.max(tonumber(ARGV[2]), 1)
  changed, probe = true, 1
elseif op == 'close' and code >= 2 then
  o, p, r = 0, 0, 0
  changed = true
elseif op == 'release' and code == 3 then
  p = 0
  changed = true
end
if changed then
  redis.call('HSET', KEYS[1], 'o', o, 'p', p, 'r', r, 'n', n)
  redis.call('PEXPIRE', KEYS[1], 86400000)
end
local c, left = phase()
return { c, left, r, n, probe }
