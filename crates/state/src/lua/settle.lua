-- Pays debts (debts.lua) on their own: a reservation settled at once, or the settlement queue's
-- debts of one hash tag that no admission took along. KEYS: per meter window hash, in-flight
-- set, period hash. ARGV: UTC day and month hints (meter.lua), then the debts.
pay_debts(3, 0)
return {}
