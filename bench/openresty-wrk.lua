-- wrk's script for bench/openresty.lua: POST /transfer between random
-- accounts a1..aN (BENCH_ACCOUNTS), amounts 1..10, and one RESULT line at
-- the end with what wrk counted.  With BENCH_PATH=/hold, POST /hold
-- (a fresh Idempotency-Key each) and, for every hold answered held,
-- POST /capture of all of it: about one capture per hold.  Runs inside
-- wrk (LuaJIT, one state per wrk thread).
-- luacheck: globals wrk request response done

local accounts = tonumber(os.getenv("BENCH_ACCOUNTS") or "100")
local path = os.getenv("BENCH_PATH") or "/transfer"
local holds = path == "/hold"
local seeded, prefix, n = false, nil, 0
local held = {} -- ids of holds answered held, not yet captured

local JSON = { ["Content-Type"] = "application/json" }

function request()
  if not seeded then
    math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16) % 100000)
    prefix = string.format("%x", math.random(0x3fffffff))
    seeded = true
  end
  if holds and #held > 0 then
    return wrk.format("POST", "/capture", JSON, string.format('{"id":"%s"}', table.remove(held)))
  end
  local from, to = math.random(accounts), math.random(accounts - 1)
  if to >= from then to = to + 1 end
  local body = string.format('{"from":"a%d","to":"a%d","amount":%d}', from, to, math.random(10))
  if not holds then return wrk.format("POST", path, JSON, body) end
  n = n + 1
  return wrk.format("POST", path, { ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. "-" .. n }, body)
end

if holds then
  function response(status, _, body)
    if status == 200 then
      local id = body:match('"status":"held"') and body:match('"id":"([%w%-_]+)"')
      if id then held[#held + 1] = id end
    end
  end
end

function done(summary, latency)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d duration_us=%d non2xx=%d socket_errors=%d " ..
    "p50_us=%d p99_us=%d\n", summary.requests, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
