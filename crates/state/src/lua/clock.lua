-- Shared head of every script: the time is Redis's own, so instances whose clocks drift agree.
-- `sec` is the current second as Redis wrote it, so bucket names are built without formatting
-- a number (Lua's number-to-string is the dearest thing a small script does).
local t = redis.call('TIME')
local sec = t[1]
local second = tonumber(sec)
local now = second * 1000 + math.floor(tonumber(t[2]) / 1000)
