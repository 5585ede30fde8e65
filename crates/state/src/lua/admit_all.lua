-- Admits several asks under one hash tag in one call, each in turn exactly as admit.lua would
-- (`admit_one` is admit.lua with its helpers, reading its own keys and arguments), all at the
-- same Redis time. The first ask carries the tag's debts.
-- ARGV: the number of asks N, then per ask its key count and argument count, then each ask's
-- arguments in turn. KEYS: each ask's keys in turn.
-- Returns per ask what admit.lua returns.
local asks = tonumber(ARGV[1])
local out = {}
local key_at, arg_at = 0, 1 + 2 * asks
for i = 1, asks do
  local key_count, arg_count = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local keys, args = {}, {}
  for j = 1, key_count do keys[j] = KEYS[key_at + j] end
  for j = 1, arg_count do args[j] = ARGV[arg_at + j] end
  key_at, arg_at = key_at + key_count, arg_at + arg_count
  out[i] = admit_one(keys, args)
end
return out
