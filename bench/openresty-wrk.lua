-- wrk's script for bench/openresty.lua: POST /transfer between random
-- accounts a1..aN (BENCH_ACCOUNTS), amounts 1..10, and one RESULT line at
-- the end with what wrk counted.  Runs inside wrk (LuaJIT, one state per
-- wrk thread).
-- luacheck: globals wrk request done

local accounts = tonumber(os.getenv("BENCH_ACCOUNTS") or "100")
local path = os.getenv("BENCH_PATH") or "/transfer"
local seeded = false

function request()
  if not seeded then
    math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16) % 100000)
    seeded = true
  end
  local from, to = math.random(accounts), math.random(accounts - 1)
  if to >= from then to = to + 1 end
  local body = string.format('{"from":"a%d","to":"a%d","amount":%d}', from, to, math.random(10))
  return wrk.format("POST", path, { ["Content-Type"] = "application/json" }, body)
end

function done(summary, latency)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d duration_us=%d non2xx=%d socket_errors=%d " ..
    "p50_us=%d p99_us=%d\n", summary.requests, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
