-- make bench-openresty: wrk against the transfer endpoint of
-- examples/openresty (spec/support/nginx.lua starts nginx), grouped
-- (db:manager{ group = {...} }, mongotx.group) against ungrouped, both
-- offloaded to the worker threads: 1 and 2 nginx workers, 1, 16 and 64
-- connections, on loopback and through toxiproxy at +1 ms round trip
-- between nginx and the server (bench/latency.lua).  Each cell runs
-- --runs times (3) in this one invocation; the table gives the medians
-- (bench/README.md, "OpenResty: group commit"), checks the issue's
-- targets, and plots bench/openresty-group.png.  After every run it checks
-- the database (every transaction done or cancelled, no marker left, the
-- sum of the balances unchanged) and fails when a check does.  Figures,
-- not a test.
--
--   luajit bench/openresty.lua [--seconds 4] [--accounts 100] [--threads 4]
--                              [--runs 3] [--delay 0] [--inflight 1] [--loopback 1|0]
--                              [--metrics 3] [--workers 1|2] [--conns n] [--hot 3] [--holds 1]
--                              [--bare 1] [--vms n]
--
-- --vms is lua_worker_thread_vm_pool_size (default twice --threads, as
-- docs/openresty.md advises: 32 VMs over 4 threads, each warming up on
-- its own, cost nginx 1.1-1.4x the CPU a request and gave a 2-4x longer
-- p99: bench/README.md, "OpenResty: the nginx side's CPU").
--
-- Each cell also runs a control, interleaved (--bare 0: none): POST /bare,
-- a transfer's round trips without mongotx (bench/bare.lua).  Its p99 over
-- p50 beside ungrouped's says how much of the tail is the library's and how
-- much the thread pool's, the server's and the machine's.
--
-- --workers and --conns run one of those only.  Then hot accounts: the
-- same load on --hot accounts (3; 0: none) and on 1 000, 2 workers, 16
-- and 64 connections, both modes, runs interleaved: no 503 on the hot
-- ones, at 0.8 x the requests/s of the 1 000 (issue 33).  A second table gives the
-- CPU each request cost nginx, the server, wrk and toxiproxy: on 2 cores
-- shared by all four, their sum bounds the requests/s of either mode.
--
-- Then holds (issue 44): POST /hold and /capture of all of it (about
-- one capture per hold: bench/openresty-wrk.lua) against /transfer, both
-- modes, 2 workers, 16 connections, runs interleaved (--holds 0: none);
-- the holds still open when wrk stops are voided before the check.
--
-- Then the cost of mongotx.metrics.shared (bench/openresty-metrics.lua):
-- --metrics rounds (0: none) with the manager's metrics off and on.
--
-- Runs from the repository's root under LuaJIT with MONGOTX_CPATH naming the
-- LuaJIT build (the Makefile sets it); starts its own mongo-java-server.

package.path = "./?.lua;./lua/?.lua;./lua/?/init.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH") or "./build/luajit/?.so"
package.cpath = cpath .. ";" .. package.cpath

local core = require "mongotx.core"
local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local latency = require "bench.latency"
local cpu = require "bench.servercpu"

local opts = { seconds = 4, accounts = 100, threads = 4, runs = 3, delay = 0, inflight = 1, loopback = 0, metrics = 3,
               workers = 0, conns = 0, hot = 3, holds = 1, bare = 1, vms = 0 }
do
  local i = 1
  while arg[i] do
    local name = arg[i]:match("^%-%-(%w+)$")
    if not name or opts[name] == nil or not tonumber(arg[i + 1]) then
      io.stderr:write("usage: bench/openresty.lua [--seconds n] [--accounts n] [--threads n] " ..
                      "[--runs n] [--delay s] [--inflight n] [--loopback 1] [--metrics rounds] [--workers n] " ..
                      "[--conns n] [--hot n] [--holds 0|1] [--bare 0|1] [--vms n]\n")
      os.exit(2)
    end
    opts[name] = tonumber(arg[i + 1])
    i = i + 2
  end
end

local VMS = opts.vms > 0 and opts.vms or 2 * opts.threads
local BALANCE = 1000000000
local WORKERS, CONNECTIONS = { 1, 2 }, { 1, 16, 64 }
if opts.workers > 0 then WORKERS = { opts.workers } end
if opts.conns > 0 then CONNECTIONS = { opts.conns } end
local MODES = { ungrouped = "false",
                grouped = ("{ max = 100, delay = %.17g, inflight = %d }"):format(opts.delay, opts.inflight) }
-- The grid's modes: bare is the control (bench/bare.lua), in an ungrouped nginx.
local GRID = { "ungrouped", "grouped" }
if opts.bare > 0 then GRID[3] = "bare" end
-- Its calls in flight: a VM fewer than nginx has, left for the recovery timer's.
local BARE = ('location = /bare { content_by_lua_block { require("bench.bare").handler(%d) } }'):format(
  math.max(VMS - 1, 1))

local capture = server.capture

local srv = assert(server.start { kind = "memory" })
local client = assert(core.connect(srv.uri))

-- The accounts of the runs: opts.accounts, but for the hot-account runs.
local accounts = opts.accounts

-- A fresh database of `accounts` accounts a1..aN.
local made = 0
local function fresh()
  made = made + 1
  local name = string.format("bench_openresty_%d_%d", os.time() % 100000, made)
  local docs = {}
  for i = 1, accounts do
    docs[i] = { _id = "a" .. i, balance = BALANCE, pendingTransactions = core.array() }
  end
  assert(client:collection(name, "accounts"):insert_many(docs))
  return name
end

-- Waits for the transactions to settle, then checks the database; returns
-- ok, a short description.
local function check(name)
  local coll = client:collection(name, "accounts")
  local txs = client:collection(name, "transactions")
  local open, marked
  for _ = 1, 300 do
    open = assert(txs:count({ state = { ["$nin"] = { "done", "cancelled" } } }))
    marked = assert(coll:count({ ["pendingTransactions.0"] = { ["$exists"] = true } }))
    if open == 0 and marked == 0 then break end
    core.sleep(0.1)
  end
  local sum = 0
  for _, d in ipairs(assert(coll:find_all({}, { sort = { _id = 1 } }))) do sum = sum + d.balance end
  local ok = open == 0 and marked == 0 and sum == BALANCE * accounts
  return ok, string.format("%d open, %d marked, sum %s", open, marked,
    sum == BALANCE * accounts and "unchanged" or "CHANGED")
end

-- wrk's output, with its CPU seconds as wrk_cpu=<s> (/usr/bin/time);
-- path: /transfer (default) or /hold (holds and their captures).
local function wrk(n, conns, seconds, path)
  return capture(string.format(
    "BENCH_ACCOUNTS=%d BENCH_PATH=%s /usr/bin/time -f 'wrk_cpu=%%U+%%S' " ..
    "wrk -t %d -c %d -d %ds -s bench/openresty-wrk.lua %s 2>&1",
    accounts, path or "/transfer", math.min(conns, 2), conns, seconds, n:url("/")))
end

-- CPU seconds so far of each process of the stack but wrk: nginx's
-- workers (their worker threads included), the server, toxiproxy.
local proxy
local function stack_cpu(n)
  local t = { nginx = 0, server = cpu.of(srv.pid) or 0, proxy = 0 }
  for _, pid in ipairs(n:workers()) do t.nginx = t.nginx + (cpu.of(pid) or 0) end
  local ppid = proxy and tonumber((server.readfile(proxy.dir .. "/pid") or ""):match("%d+"))
  if ppid then t.proxy = cpu.of(ppid) or 0 end
  return t
end

local function start(uri, name, workers, mode)
  return assert(nginx.start { uri = uri, database = name, workers = workers,
    threads = opts.threads, vms = VMS, locations = BARE, configure = ("{ manager = { " ..
    "application = 'bench', group = %s }, recovery = { every = 1 } }"):format(
    MODES[mode] or MODES.ungrouped) })
end

-- wrk against nginx n: { requests, rps, p50, p99 (ms), non2xx, socket,
-- nginx, server, wrk, proxy (CPU microseconds a request), out }.
local function measure(n, conns, path)
  local before = stack_cpu(n)
  local out = wrk(n, conns, opts.seconds, path)
  local after = stack_cpu(n)
  local r = {}
  for k, v in out:gmatch("([%w_]+)=(%d+)") do r[k] = tonumber(v) end
  local requests = math.max(r.requests or 1, 1)
  local x = { requests = r.requests, rps = (r.requests or 0) / ((r.duration_us or 1) / 1e6),
              p50 = (r.p50_us or 0) / 1000, p99 = (r.p99_us or 0) / 1000, non2xx = r.non2xx or 0,
              socket = r.socket_errors or 0, out = out }
  for k in pairs(before) do x[k] = (after[k] - before[k]) * 1e6 / requests end
  local wu, ws = out:match("wrk_cpu=([%d.]+)%+([%d.]+)")
  x.wrk = ((tonumber(wu) or 0) + (tonumber(ws) or 0)) * 1e6 / requests
  return x
end

-- The holds of run `name` that wrk left open, voided; returns how many
-- were captured.
local function settle_holds(name)
  local db = assert(require("mongotx").connect(srv.uri, { database = name }))
  local tm = assert(db:manager { application = "bench" })
  local txs = db:collection("transactions")
  for _, T in ipairs(assert(txs:find_all({ state = "pending", hold = { ["$exists"] = true } },
                                          { projection = { _id = 1 } }))) do
    assert(tm:void(T._id))
  end
  local captured = assert(txs:count({ state = "done", hold = { ["$exists"] = true } }))
  db:close()
  return captured
end

-- One run: requests/s, p50 and p99 (ms), errors, database ok, what; with
-- path /hold also captured/s (holds captured a second).
local failed = 0
local function run(uri, workers, mode, conns, path)
  local name = fresh()
  local n = start(uri, name, workers, mode)
  -- every worker makes its manager before the timed part
  for _ = 1, 4 * workers do n:request("POST", "/transfer", '{"from":"a1","to":"a2","amount":1}') end
  local r = measure(n, conns, mode == "bare" and "/bare" or path)
  n:stop()
  if path == "/hold" then r.captured = settle_holds(name) / opts.seconds end
  local ok, what = check(name)
  if not r.requests then ok, what = false, "wrk: " .. r.out end
  if not ok then failed = failed + 1 end
  client:command(name, { dropDatabase = 1 })
  r.ok, r.what = ok, what
  return r
end

local function median(list, field)
  local xs = {}
  for i, x in ipairs(list) do xs[i] = x[field] end
  table.sort(xs)
  local m = #xs
  if m % 2 == 1 then return xs[(m + 1) / 2] end
  return (xs[m / 2] + xs[m / 2 + 1]) / 2
end

-- The server's JIT warms up over the first thousands of transfers: a run
-- of each mode, not counted, comes first.
local function warm_up()
  for mode in pairs(MODES) do
    local name = fresh()
    local n = start(srv.uri, name, 2, mode)
    wrk(n, 16, opts.seconds)
    n:stop()
    client:command(name, { dropDatabase = 1 })
  end
end

-- The processes whose CPU a request costs (stack_cpu, wrk).
local CPU = { "nginx", "server", "wrk", "proxy" }
local CORES = tonumber(capture("nproc")) or 1

local levels = { { key = "loopback", label = "loopback", uri = srv.uri } }
if opts.loopback ~= 1 then
  local err
  proxy, err = latency.start(srv.uri)
  if not proxy then
    io.stderr:write("bench-openresty: ", err, " (--loopback 1 runs without toxiproxy)\n")
    os.exit(1)
  end
  for _, level in ipairs(latency.LEVELS) do
    if level.key == "1ms" then
      levels[2] = { key = "1ms", label = "+1 ms", uri = proxy.uri, level = level }
    end
  end
end

warm_up()
local load1 = capture("cat /proc/loadavg"):match("^(%S+ %S+ %S+)")
local started = os.time()
local rows, bare_rows, cells, pings = {}, {}, {}, {}

for _, lv in ipairs(levels) do
  if proxy then
    proxy:set(lv.level)
    pings[lv.key] = latency.ping(proxy.uri, 200).median
  end
  for _, workers in ipairs(WORKERS) do
    for _, conns in ipairs(CONNECTIONS) do
      local res = { ungrouped = {}, grouped = {}, bare = {} }
      for i = 1, opts.runs do
        for _, mode in ipairs(GRID) do
          res[mode][i] = run(lv.uri, workers, mode, conns)
          local x = res[mode][i]
          io.stderr:write(string.format("%s %d workers %d conns %s run %d: %.0f req/s p50 %.2f " ..
            "p99 %.2f ms, %d non-2xx, %d socket errors, %s\n", lv.key, workers, conns, mode, i,
            x.rps, x.p50, x.p99, x.non2xx, x.socket, x.what))
        end
      end
      local c = { level = lv, workers = workers, conns = conns }
      for _, mode in ipairs(GRID) do
        c[mode] = { rps = median(res[mode], "rps"), p50 = median(res[mode], "p50"),
                    p99 = median(res[mode], "p99"), non2xx = 0, socket = 0, ok = true }
        for _, k in ipairs(CPU) do c[mode][k] = median(res[mode], k) end
        for _, x in ipairs(res[mode]) do
          c[mode].non2xx, c[mode].socket = c[mode].non2xx + x.non2xx, c[mode].socket + x.socket
          c[mode].ok = c[mode].ok and x.ok
        end
      end
      cells[#cells + 1] = c
      local u, g = c.ungrouped, c.grouped
      rows[#rows + 1] = string.format("| %s | %d | %d | %.0f | %.0f | %.2fx | %.2f | %.2f | %.2f | %.2f " ..
        "| %d / %d | %d / %d | %s |", lv.label, workers, conns, u.rps, g.rps,
        g.rps / math.max(u.rps, 1), u.p50, g.p50, u.p99, g.p99, u.non2xx, g.non2xx, u.socket,
        g.socket, (u.ok and g.ok) and "ok" or "FAILED")
      io.stderr:write(rows[#rows], "\n")
      if c.bare then
        bare_rows[#bare_rows + 1] = string.format("| %s | %d | %d | %.2f / %.2f (%.1fx) " ..
          "| %.2f / %.2f (%.1fx) | %.0f | %.0f |", lv.label, workers, conns, u.p50, u.p99,
          u.p99 / math.max(u.p50, 0.001), c.bare.p50, c.bare.p99,
          c.bare.p99 / math.max(c.bare.p50, 0.001), u.rps, c.bare.rps)
      end
    end
  end
end
if proxy then proxy:stop() end

-- The issue's targets (#22), checked on the medians.
local targets = {}
local function target(ok, what)
  targets[#targets + 1] = (ok and "- met: " or "- NOT met: ") .. what
end

-- Hot accounts (issue 33): every transfer is guarded (min = 0), so on 3
-- accounts every debit meets credits in flight to its account.
local hot_rows, hot_plot = {}, {}
local COLD = 1000
if opts.hot > 0 then
  for _, conns in ipairs { 16, 64 } do
    for _, mode in ipairs { "ungrouped", "grouped" } do
      local res = { [opts.hot] = {}, [COLD] = {} }
      for i = 1, opts.runs do
        for _, n in ipairs { opts.hot, COLD } do
          accounts = n
          local x = run(srv.uri, 2, mode, conns)
          res[n][i] = x
          io.stderr:write(string.format("hot: %d accounts, 2 workers, %d conns, %s, run %d: %.0f req/s, " ..
            "%d non-2xx, %s\n", n, conns, mode, i, x.rps, x.non2xx, x.what))
        end
      end
      accounts = opts.accounts
      local hot, cold = median(res[opts.hot], "rps"), median(res[COLD], "rps")
      local non2xx, ok = 0, true
      for _, n in ipairs { opts.hot, COLD } do
        for _, x in ipairs(res[n]) do
          if n == opts.hot then non2xx = non2xx + x.non2xx end
          ok = ok and x.ok
        end
      end
      hot_rows[#hot_rows + 1] = string.format("| %d | %s | %.0f | %.0f | %.2f | %.2f / %.2f | %.2f / %.2f " ..
        "| %d | %s |", conns, mode, hot, cold, hot / math.max(cold, 1), median(res[opts.hot], "p50"),
        median(res[opts.hot], "p99"), median(res[COLD], "p50"), median(res[COLD], "p99"), non2xx,
        ok and "ok" or "FAILED")
      hot_plot[#hot_plot + 1] = string.format('"%d conns, %s" %.0f %.0f', conns, mode, hot, cold)
      target(hot >= 0.8 * cold and non2xx == 0, string.format("%d hot accounts, 2 workers, %d " ..
        "connections, %s: %.2fx the requests/s of %d accounts (0.8x wanted), %d non-2xx in %d runs",
        opts.hot, conns, mode, hot / math.max(cold, 1), COLD, non2xx, opts.runs))
    end
  end
end
for _, c in ipairs(cells) do
  local u, g, where = c.ungrouped, c.grouped, string.format("%s, %d worker(s), %d connection(s)",
    c.level.label, c.workers, c.conns)
  if c.conns == 64 then
    local want = c.level.key == "loopback" and 2.5 or 5
    target(g.rps >= want * u.rps, string.format("grouped >= %.1fx ungrouped requests/s (%s): %.2fx",
      want, where, g.rps / math.max(u.rps, 1)))
  end
  if c.conns >= 16 then
    target(g.p99 <= u.p99, string.format("grouped p99 <= ungrouped p99 (%s): %.2f vs %.2f ms",
      where, g.p99, u.p99))
    target(u.p99 <= 5 * u.p50, string.format("ungrouped p99 <= 5x its p50 (%s): %.1fx%s", where,
      u.p99 / math.max(u.p50, 0.001), c.bare and string.format(" (the same round trips " ..
      "without mongotx: %.1fx)", c.bare.p99 / math.max(c.bare.p50, 0.001)) or ""))
  end
  if c.conns == 1 then
    target(g.p50 <= u.p50 + opts.delay * 1000 + 0.5, string.format("grouped p50 within delay " ..
      "+ 0.5 ms of ungrouped (%s): %.2f vs %.2f ms", where, g.p50, u.p50))
  end
end

-- The plot: requests/s by connections, a line per network, workers and mode.
do
  local data = os.tmpname()
  local f = assert(io.open(data, "w"))
  local series = {}
  for _, c in ipairs(cells) do
    for _, mode in ipairs { "ungrouped", "grouped" } do
      local key = string.format("%s, %d worker%s, %s", c.level.label, c.workers,
        c.workers > 1 and "s" or "", mode)
      if not series[key] then
        series[key] = {}
        series[#series + 1] = key
      end
      series[key][#series[key] + 1] = string.format("%d %.0f", c.conns, c[mode].rps)
    end
  end
  for _, key in ipairs(series) do
    f:write(string.format('"%s"\n%s\n\n\n', key, table.concat(series[key], "\n")))
  end
  f:close()
  local rc = os.execute(("gnuplot -e %s bench/openresty-group.gp"):format(server.quote(
    ("data='%s'; out='bench/openresty-group.png'; n=%d"):format(data, #series))))
  if rc ~= 0 and rc ~= true then io.stderr:write("bench-openresty: gnuplot failed\n") end
  os.remove(data)
end

-- The hot-account plot: requests/s of each cell on the hot accounts and on COLD.
if #hot_plot > 0 then
  local data = os.tmpname()
  local f = assert(io.open(data, "w"))
  f:write(table.concat(hot_plot, "\n"), "\n")
  f:close()
  local rc = os.execute(("gnuplot -e %s bench/openresty-hot.gp"):format(server.quote(
    ("data='%s'; out='bench/openresty-hot.png'; hot=%d; cold=%d"):format(data, opts.hot, COLD))))
  if rc ~= 0 and rc ~= true then io.stderr:write("bench-openresty: gnuplot failed\n") end
  os.remove(data)
end

local load2 = capture("cat /proc/loadavg"):match("^(%S+ %S+ %S+)")
print(string.format("Measured %s UTC in %.1f minutes: medians of %d runs of %d s, %d accounts, " ..
  "thread_pool threads=%d, lua_worker_thread_vm_pool_size %d, group = { max = 100, delay = %g, inflight = %d }; " ..
  "load average %s before, %s after; server: mongo-java-server memory%s.",
  os.date("!%Y-%m-%d %H:%M"), (os.time() - started) / 60, opts.runs, opts.seconds, opts.accounts,
  opts.threads, VMS, opts.delay, opts.inflight, load1, load2, pings["1ms"] and string.format(
  "; ping round trip through toxiproxy at +1 ms: %.2f ms", pings["1ms"]) or ""))
print()
print("| network | nginx workers | connections | ungrouped req/s | grouped req/s | grouped/ungrouped " ..
      "| ungrouped p50 ms | grouped p50 ms | ungrouped p99 ms | grouped p99 ms " ..
      "| non-2xx (ungrouped / grouped) | wrk socket errors (ungrouped / grouped) " ..
      "| database after every run |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for _, row in ipairs(rows) do print(row) end
print()
print(string.format("CPU microseconds a request (medians), by process, and the requests/s the " ..
  "machine's %d cores could serve at that cost (ceiling):", CORES))
print()
print("| network | nginx workers | connections | mode | nginx | server | wrk | toxiproxy | total | ceiling req/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for _, c in ipairs(cells) do
  for _, mode in ipairs(GRID) do
    local x, total = c[mode], 0
    for _, k in ipairs(CPU) do total = total + x[k] end
    print(string.format("| %s | %d | %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |", c.level.label,
      c.workers, c.conns, mode, x.nginx, x.server, x.wrk, x.proxy, total, CORES * 1e6 / math.max(total, 1)))
  end
end
if #bare_rows > 0 then
  print()
  print("The control: the same round trips without mongotx (POST /bare, bench/bare.lua), " ..
    "in the same runs, beside ungrouped mongotx; p50 / p99 ms (p99 over p50):")
  print()
  print("| network | nginx workers | connections | ungrouped mongotx | bare | ungrouped req/s | bare req/s |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for _, row in ipairs(bare_rows) do print(row) end
end
if #hot_rows > 0 then
  print()
  print(string.format("Hot accounts: requests/s (medians of %d runs of %d s, loopback, 2 workers), " ..
    "every transfer guarded, on %d accounts and on %d:", opts.runs, opts.seconds, opts.hot, COLD))
  print()
  print(string.format("| connections | mode | %d accounts req/s | %d accounts req/s | ratio " ..
    "| p50 / p99 ms on %d | p50 / p99 ms on %d | non-2xx on %d (all runs) | database after every run |",
    opts.hot, COLD, opts.hot, COLD, opts.hot))
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for _, row in ipairs(hot_rows) do print(row) end
end
-- Holds against transfers (issue 44), the same load, runs interleaved.
local hold_rows = {}
if opts.holds > 0 then
  for _, mode in ipairs { "ungrouped", "grouped" } do
    local tr, ho = {}, {}
    for i = 1, opts.runs do
      tr[i] = run(srv.uri, 2, mode, 16, "/transfer")
      ho[i] = run(srv.uri, 2, mode, 16, "/hold")
      io.stderr:write(string.format("holds: %s run %d: %.0f transfers/s; %.0f requests/s, %.0f " ..
        "holds captured/s, %d non-2xx, %s\n", mode, i, tr[i].rps, ho[i].rps, ho[i].captured,
        ho[i].non2xx, ho[i].what))
    end
    local non2xx, ok, ratios = 0, true, {}
    for i = 1, opts.runs do
      non2xx, ok = non2xx + ho[i].non2xx, ok and ho[i].ok and tr[i].ok
      ratios[i] = { r = ho[i].captured / math.max(tr[i].rps, 1) } -- of the runs side by side
    end
    hold_rows[#hold_rows + 1] = string.format("| %s | %.0f | %.0f | %.0f | %.2f | %.2f / %.2f | %d | %s |",
      mode, median(tr, "rps"), median(ho, "rps"), median(ho, "captured"), median(ratios, "r"),
      median(ho, "p50"), median(ho, "p99"), non2xx, ok and "ok" or "FAILED")
  end
end
if #hold_rows > 0 then
  print()
  print(string.format("Holds (medians of %d runs of %d s, loopback, 2 workers, 16 connections): a " ..
    "hold and its capture are two requests, so captured/s is what replaces transfers/s:", opts.runs,
    opts.seconds))
  print()
  print("| mode | transfers/s | hold or capture requests/s | holds captured/s | captured / transfers " ..
    "(median of each run's) | p50 / p99 ms (holds run) | non-2xx (holds, all runs) | database after every run |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for _, row in ipairs(hold_rows) do print(row) end
end
print()
print("Targets (issues 22, 33 and 41):")
for _, t in ipairs(targets) do print(t) end
if opts.metrics > 0 then failed = failed + require("bench.openresty-metrics")(opts, {
  srv = srv, fresh = fresh, check = check, measure = measure, CPU = CPU, vms = VMS }) end
srv:stop()
if failed > 0 then
  io.stderr:write(failed, " run(s) failed their check\n")
  os.exit(1)
end
