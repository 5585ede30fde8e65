-- wrk script for bench/run: POSTs one small, non-streaming chat completion per request.
--
--   BENCH_MODEL        the body's "model" (the alias through the gateway; Azure ignores it)
--   BENCH_AUTH_HEADER  the credential header's name (api-key for Azure, authorization for onedoor)
--   BENCH_AUTH_VALUE   its value
--   BENCH_PROMPT_BYTES the user message padded with prose to this many bytes (a long prompt)
--
-- At the end it prints one machine-readable line that bench/run reads:
--   BENCH requests=N duration_us=N rps=F p50_us=N p90_us=N p99_us=N max_us=N
--         connect_errors=N read_errors=N write_errors=N timeouts=N non2xx=N

wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers[os.getenv("BENCH_AUTH_HEADER") or "authorization"] = os.getenv("BENCH_AUTH_VALUE") or ""
local question = "Say hello in five words."
local prompt_bytes = tonumber(os.getenv("BENCH_PROMPT_BYTES") or "")
if prompt_bytes and prompt_bytes > #question then
  local prose = " The quick brown fox jumps over the lazy dog by the river, and the dog lets it."
  local parts = { question }
  local size = #question
  while size + #prose <= prompt_bytes do
    parts[#parts + 1] = prose
    size = size + #prose
  end
  parts[#parts + 1] = string.rep(".", prompt_bytes - size)
  question = table.concat(parts)
end
wrk.body = string.format(
  '{"model":"%s","messages":[{"role":"system","content":"You are terse."},' ..
  '{"role":"user","content":"%s"}],"max_tokens":32}',
  os.getenv("BENCH_MODEL") or "chat", question)

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d rps=%.1f p50_us=%d p90_us=%d p99_us=%d max_us=%d " ..
    "connect_errors=%d read_errors=%d write_errors=%d timeouts=%d non2xx=%d\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.timeout, e.status))
end
