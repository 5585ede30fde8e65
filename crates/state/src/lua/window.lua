-- Shared head of the scripts that read meters: the rolling minute and the short window of one
-- meter. A meter's window is one hash: per-second buckets `r<second>` and `t<second>` (requests,
-- tokens) and running sums of them, `R` and `T` over the minute, `R10` and `T10` over the short
-- window (the current second's buckets and the ten before, as meter.rs's `Window::recent`), all
-- exact for the second `O` + 59. While `O` is still the oldest second of the minute the sums are
-- read as they are; otherwise the buckets are summed again and (with `prune`) the stale ones
-- dropped and the sums written back: once a second per meter. `L` is when the meter's in-flight
-- set expires (see `lease_to`). Each redis.call costs about as much as the work it does, so a
-- charge reads the hash once and writes it once.
local oldest = second - 59
local recent_from = second - 10
local r_now, t_now = 'r' .. sec, 't' .. sec

-- Sums every bucket again; with `prune` drops the stale ones and writes the sums back.
local function resum(w, m, prune)
  local r, tk, r10, t10 = 0, 0, 0, 0
  local all = redis.call('HGETALL', w)
  for i = 1, #all, 2 do
    local field = all[i]
    local kind = string.sub(field, 1, 1)
    if kind == 'r' or kind == 't' then
      local s = tonumber(string.sub(field, 2))
      if s == nil or s < oldest then
        if prune then redis.call('HDEL', w, field) end
      else
        local n = tonumber(all[i + 1])
        if kind == 'r' then
          r = r + n
          if s >= recent_from then r10 = r10 + n end
        else
          tk = tk + n
          if s >= recent_from then t10 = t10 + n end
        end
      end
    end
  end
  m.r, m.t, m.r10, m.t10 = r, tk, r10, t10
  if prune then
    redis.call('HSET', w, 'R', r, 'T', tk, 'O', oldest, 'R10', r10, 'T10', t10)
    redis.call('PEXPIRE', w, 62000)
  end
end

-- One meter's window: requests and tokens in the minute (r, t) and the short window (r10, t10),
-- the current second's buckets (rb, tb), when its in-flight set expires (lease), whether the
-- sums were made again now (summed), and the raw values read (v: after the eight fields above,
-- those of `extra`, a list of field names).
local function window(w, prune, extra)
  local v
  if extra then
    v = redis.call('HMGET', w, 'R', 'T', 'O', 'R10', 'T10', r_now, t_now, 'L', unpack(extra))
  else
    v = redis.call('HMGET', w, 'R', 'T', 'O', 'R10', 'T10', r_now, t_now, 'L')
  end
  local m = {
    rb = tonumber(v[6]) or 0,
    tb = tonumber(v[7]) or 0,
    lease = tonumber(v[8]) or 0,
    summed = false,
    v = v,
  }
  if v[3] and v[4] and tonumber(v[3]) >= oldest then
    m.r, m.t = tonumber(v[1]) or 0, tonumber(v[2]) or 0
    m.r10, m.t10 = tonumber(v[4]) or 0, tonumber(v[5]) or 0
  else
    resum(w, m, prune)
    m.summed = true
  end
  return m
end

-- Counts `requests` and `tokens` in the current second's buckets and every sum of window `m`
-- (read by `window` in this call), in one write, with the corrections folded into `m` (debts.lua)
-- and the field-value pairs given after `tokens`.
local function count_in_window(w, m, requests, tokens, ...)
  m.rb, m.tb = m.rb + requests, m.tb + tokens
  m.r, m.t, m.r10, m.t10 = m.r + requests, m.t + tokens, m.r10 + requests, m.t10 + tokens
  local x = m.corrected
  if x then
    m.corrected = nil
    local args = { r_now, m.rb, t_now, m.tb, 'R', m.r, 'T', m.t, 'R10', m.r10, 'T10', m.t10, ... }
    for k = 1, #x do args[#args + 1] = x[k] end
    redis.call('HSET', w, unpack(args))
  else
    redis.call('HSET', w, r_now, m.rb, t_now, m.tb, 'R', m.r, 'T', m.t, 'R10', m.r10, 'T10', m.t10, ...)
  end
end

-- The in-flight set `f` must live until `until_ms`: extended (with a minute to spare, so the
-- next requests need not) only when it would not. Returns the field pair for the window's `L`.
local function lease_to(f, m, until_ms)
  if until_ms <= m.lease then return end
  m.lease = until_ms + 60000
  redis.call('PEXPIREAT', f, m.lease)
  return 'L', m.lease
end
