-- Shared head of every script: the time is Redis's own, so instances whose clocks drift agree.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
