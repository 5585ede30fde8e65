-- Checks every meter against its limits and charges all of them only when all have room; first
-- it pays what earlier requests of this instance still owe the same hash tag (debts.lua; those
-- of its own meters folded into its reads and writes), so the check sees their ends and real
-- usage.
-- KEYS: per meter its window hash, in-flight set and period hash (all under one hash tag), then
-- those of the other meters the debts name.
-- ARGV: UTC day and month hints (meter.lua), meter count N, tokens, millionths of a dollar, lease
-- ms, in-flight member, enforce (0/1), then per meter rpm, tpm, max_in_flight, tokens_per_day,
-- micro_usd_per_month (-1: no limit), then the debts (debts.lua).
-- Returns {1, second, day, month, per meter: requests, tokens, in flight, day tokens, month
-- spend, requests and tokens of the last ten seconds after the charge} or {0, meter, limit code, retry ms, used, cap, asked, per meter usage}.
local n = tonumber(ARGV[3])
local owed = pay_debts(9 + 5 * n, n)
local tokens = tonumber(ARGV[4])
local usd = tonumber(ARGV[5])
local lease = tonumber(ARGV[6])
local member = ARGV[7]
local enforce = ARGV[8] == '1'

local meters = {}
for i = 1, n do
  local m = read_meter(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], true, owed[i])
  if owed[i] then fold(m, owed[i]) end
  local b = 8 + 5 * (i - 1)
  m.rpm, m.tpm, m.cap = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  m.dcap, m.mcap = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  meters[i] = m
end

-- When the window has room for `asked` more under `cap`: the oldest buckets that must go, gone.
local function frees(list, used, cap, asked)
  for _, e in ipairs(list) do
    used = used - e[2]
    if used + asked <= cap then return math.max((e[1] + 60) * 1000 - now, 1) end
  end
  return 60000
end

local function usage(out)
  for i = 1, n do
    local m = meters[i]
    out[#out + 1] = m.r
    out[#out + 1] = m.t
    out[#out + 1] = m.fly
    out[#out + 1] = m.d
    out[#out + 1] = m.m
    out[#out + 1] = m.r10
    out[#out + 1] = m.t10
  end
  return out
end

-- A refusal writes what the debts folded in before it reads buckets for its retry-after.
local written = false
local function write_all_folded()
  if written then return end
  written = true
  for i = 1, n do write_folded(KEYS[3 * i - 2], KEYS[3 * i], meters[i]) end
end
local function live_buckets(w, kind)
  write_all_folded()
  return buckets(w, kind)
end

if enforce then
  local period, rate = nil, nil
  for i = 1, n do
    local m = meters[i]
    local checks = {}
    if m.dcap >= 0 and m.d + tokens > m.dcap then checks[#checks + 1] = { 4, (day + 1) * 86400000 - now, m.d, m.dcap, tokens } end
    if m.mcap >= 0 and m.m + usd > m.mcap then checks[#checks + 1] = { 5, month_ends_in(), m.m, m.mcap, usd } end
    local w = KEYS[3 * i - 2]
    if m.rpm >= 0 and m.r + 1 > m.rpm then checks[#checks + 1] = { 1, frees(live_buckets(w, 'r'), m.r, m.rpm, 1), m.r, m.rpm, 1 } end
    if m.tpm >= 0 and m.t + tokens > m.tpm then checks[#checks + 1] = { 2, frees(live_buckets(w, 't'), m.t, m.tpm, tokens), m.t, m.tpm, tokens } end
    if m.cap >= 0 and m.fly + 1 > m.cap then checks[#checks + 1] = { 3, 1000, m.fly, m.cap, 1 } end
    for _, c in ipairs(checks) do
      if c[1] >= 4 then
        if period == nil then period = { i, c } end
      elseif rate == nil or c[2] > rate[2][2] then
        rate = { i, c }
      end
    end
  end
  local refused = period or rate
  if refused then
    write_all_folded()
    local c = refused[2]
    return usage({ 0, refused[1] - 1, c[1], c[2], c[3], c[4], c[5] })
  end
end

for i = 1, n do
  local w, f, p = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local m = meters[i]
  redis.call('ZADD', f, now + lease, member)
  count_in_window(w, m, 1, tokens, lease_to(f, m, now + lease + 1000))
  charge_period(p, m, tokens, usd)
  m.fly = m.fly + 1
end
return usage({ 1, second, day, month })
