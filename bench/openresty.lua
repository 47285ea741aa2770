-- make bench-openresty: wrk against the transfer endpoint of
-- examples/openresty (spec/support/nginx.lua starts nginx), with 1 and 2
-- nginx workers, 1, 4 and 16 connections, the transfer offloaded to the
-- worker threads (POST /transfer) and run in the worker itself (POST
-- /direct/transfer).  Prints a markdown table of requests/s and latencies
-- (bench/README.md, "OpenResty"); after every run it checks the database
-- (every transaction done or cancelled, no marker left, the sum of the
-- balances unchanged) and fails when a check does.  Not a timed test.
--
--   luajit bench/openresty.lua [--seconds 5] [--accounts 100] [--threads 4]
--                              [--metrics 3] [--main 1]
--
-- Then the cost of mongotx.metrics.shared: --metrics rounds (0: none) of
-- the same run (2 workers, offloaded, 16 connections) with the manager's
-- metrics off and on, in alternating order, and the medians; and the time
-- the events of one transfer cost in a worker (a loop over the shared
-- dict).  --main 0 skips the main table.
--
-- Runs from the repository's root under LuaJIT with MONGOTX_CPATH naming the
-- LuaJIT build (the Makefile sets it); starts its own mongo-java-server.

package.path = "./?.lua;./lua/?.lua;./lua/?/init.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH") or "./build/luajit/?.so"
package.cpath = cpath .. ";" .. package.cpath

local core = require "mongotx.core"
local server = require "spec.support.server"
local nginx = require "spec.support.nginx"

local opts = { seconds = 5, accounts = 100, threads = 4, metrics = 3, main = 1 }
do
  local i = 1
  while arg[i] do
    local name = arg[i]:match("^%-%-(%w+)$")
    if not name or opts[name] == nil or not tonumber(arg[i + 1]) then
      io.stderr:write("usage: bench/openresty.lua [--seconds n] [--accounts n] [--threads n] " ..
                      "[--metrics rounds] [--main 0|1]\n")
      os.exit(2)
    end
    opts[name] = tonumber(arg[i + 1])
    i = i + 2
  end
end

local BALANCE = 1000000000

local capture = server.capture

local srv = assert(server.start { kind = "memory" })
local client = assert(core.connect(srv.uri))

-- A fresh database of opts.accounts accounts a1..aN.
local function fresh(n)
  local name = string.format("bench_openresty_%d_%d", os.time() % 100000, n)
  local docs = {}
  for i = 1, opts.accounts do
    docs[i] = { _id = "a" .. i, balance = BALANCE, pendingTransactions = core.array() }
  end
  assert(client:collection(name, "accounts"):insert_many(docs))
  return name
end

-- Waits for the transactions to settle, then checks the database; returns
-- ok, a short description.
local function check(name)
  local accounts = client:collection(name, "accounts")
  local txs = client:collection(name, "transactions")
  local open, marked
  for _ = 1, 300 do
    open = assert(txs:count({ state = { ["$nin"] = { "done", "cancelled" } } }))
    marked = assert(accounts:count({ ["pendingTransactions.0"] = { ["$exists"] = true } }))
    if open == 0 and marked == 0 then break end
    core.sleep(0.1)
  end
  local sum = 0
  for _, d in ipairs(assert(accounts:find_all({}))) do sum = sum + d.balance end
  local done = assert(txs:count({ state = "done" }))
  local ok = open == 0 and marked == 0 and sum == BALANCE * opts.accounts
  return ok, string.format("%d done, %d open, %d marked, sum %s", done, open, marked,
    sum == BALANCE * opts.accounts and "unchanged" or "CHANGED"), done
end

-- The server's JIT warms up over the first thousands of transfers: a run
-- of each mode, not counted, comes first.
local function warm_up()
  local name = fresh(0)
  local n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, threads = opts.threads,
    vms = 32, recovery = false })
  for _, path in ipairs { "/transfer", "/direct/transfer" } do
    capture(string.format("BENCH_ACCOUNTS=%d BENCH_PATH=%s wrk -t 2 -c 8 -d %ds " ..
      "-s bench/openresty-wrk.lua %s 2>&1", opts.accounts, path, opts.seconds, n:url("/")))
  end
  n:stop()
  client:command(name, { dropDatabase = 1 })
end

warm_up()
local rows, failed, run = {}, 0, 0
local load1 = capture("cat /proc/loadavg"):match("^(%S+ %S+ %S+)")
local started = os.time()

for _, workers in ipairs(opts.main ~= 0 and { 1, 2 } or {}) do
  for _, mode in ipairs { "offloaded", "direct" } do
    for _, conns in ipairs { 1, 4, 16 } do
      run = run + 1
      local name = fresh(run)
      local n = assert(nginx.start { uri = srv.uri, database = name, workers = workers,
        threads = opts.threads, vms = 32, configure =
        "{ manager = { application = 'bench' }, recovery = { every = 1 } }" })
      -- every worker makes its manager before the timed part
      for _ = 1, 4 * workers do
        n:request("POST", mode == "direct" and "/direct/transfer" or "/transfer",
                  '{"from":"a1","to":"a2","amount":1}')
      end
      local out = capture(string.format(
        "BENCH_ACCOUNTS=%d BENCH_PATH=%s wrk -t %d -c %d -d %ds -s bench/openresty-wrk.lua %s 2>&1",
        opts.accounts, mode == "direct" and "/direct/transfer" or "/transfer",
        math.min(conns, 2), conns, opts.seconds, n:url("/")))
      n:stop()
      local r = {}
      for k, v in out:gmatch("([%w_]+)=(%d+)") do r[k] = tonumber(v) end
      local ok, what = check(name)
      if not r.requests then
        ok, what = false, "wrk: " .. out
      end
      if not ok then failed = failed + 1 end
      rows[#rows + 1] = string.format("| %d | %s | %d | %.0f | %.1f | %.1f | %d | %s |",
        workers, mode, conns, (r.requests or 0) / ((r.duration_us or 1) / 1e6),
        (r.p50_us or 0) / 1000, (r.p99_us or 0) / 1000,
        (r.non2xx or 0) + (r.socket_errors or 0), (ok and "ok: " or "FAILED: ") .. what)
      io.stderr:write(rows[#rows], "\n")
      client:command(name, { dropDatabase = 1 })
    end
  end
end

local load2 = capture("cat /proc/loadavg"):match("^(%S+ %S+ %S+)")
print(string.format("Measured %s UTC in %.1f minutes, %d s per run, %d accounts, thread_pool " ..
  "threads=%d; load average %s before, %s after; server: mongo-java-server memory on loopback.",
  os.date("!%Y-%m-%d %H:%M"), (os.time() - started) / 60, opts.seconds, opts.accounts,
  opts.threads, load1, load2))
print()
print("| nginx workers | transfer | connections | requests/s | p50 ms | p99 ms | errors | database after the run |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for _, row in ipairs(rows) do print(row) end
if opts.metrics > 0 then failed = failed + require("bench.openresty-metrics")(opts, {
  srv = srv, fresh = fresh, check = check, capture = capture }) end
srv:stop()
if failed > 0 then
  io.stderr:write(failed, " run(s) failed their check\n")
  os.exit(1)
end
