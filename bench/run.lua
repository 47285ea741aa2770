-- bench/run.lua: the driver of `make bench`.  Runs every mode against the
-- server in MONGOTX_TEST_URI (spec/support/with-server starts one), each
-- several times on a fresh database, prints the medians as a table and,
-- for a full run, writes that table into bench/README.md (between its
-- results markers) and plots bench/throughput.png with gnuplot.
--
--   lua5.4 bench/run.lua [--runs N] [--scale F] [--only key,key...]
--
--   --runs   runs per mode (default 5; 3 for commit_many at batch 1000, the
--            recovery and the process modes)
--   --scale  multiplies every transfer count (default 1; e.g. 0.1 to try it)
--   --only   run these modes only (keys as printed); README and plot are
--            left alone unless the run is full (no --only, scale 1, no
--            --accounts)
--   --accounts  accounts of the single-process modes (default 10 000; at
--            least twice the largest batch run)
--
-- Exits non-zero when a mode's check of the database failed.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local modes = require "bench.modes"
local concurrent = require "bench.concurrent"
local stats = require "bench.stats"
local server = require "spec.support.server"

local round = stats.round
local BOUND = 2 / 7 -- writes of a raw transfer over the protocol's minimum

local opts = { runs = nil, scale = 1, only = nil, accounts = nil }
do
  local i = 1
  while arg[i] do
    local a, v = arg[i], arg[i + 1]
    if a == "--runs" then opts.runs = assert(tonumber(v), "--runs N")
    elseif a == "--scale" then opts.scale = assert(tonumber(v), "--scale F")
    elseif a == "--accounts" then opts.accounts = assert(tonumber(v), "--accounts N")
    elseif a == "--only" then
      opts.only = {}
      for k in v:gmatch("[^,]+") do opts.only[k] = true end
    else error("unknown argument " .. a) end
    i = i + 2
  end
end

local uri = assert(os.getenv("MONGOTX_TEST_URI"),
  "MONGOTX_TEST_URI is not set: run through `make bench` or spec/support/with-server")

-- What runs, in order.  n is the transfers per run (before --scale).
local plan = {
  { key = "raw", mode = modes.raw, n = 5000 },
  { key = "textbook", mode = modes.textbook, n = 1000 },
  { key = "transfer", mode = modes.transfer, n = 1000 },
  { key = "transfer_guarded", mode = modes.transfer_guarded, n = 1000 },
  { key = "transfer_deferred", mode = modes.transfer_deferred, n = 1000 },
  { key = "begin_commit", mode = modes.begin_commit, n = 1000 },
}
-- (counts chosen so that `make bench` stays near 15 minutes on 2 cores)
for _, b in ipairs { { 1, 1000, 5 }, { 10, 1000, 5 }, { 100, 3000, 5 }, { 1000, 5000, 3 } } do
  plan[#plan + 1] = { key = "commit_many" .. b[1], mode = modes.commit_many, batch = b[1], n = b[2],
                      runs = b[3] }
end
plan[#plan + 1] = { key = "transfer_many100", mode = modes.transfer_many, batch = 100, n = 3000 }
-- guarded (min = 0): on 10 000 accounts, and hot: 10 accounts, each
-- debited and credited about ten times within every batch of 100
plan[#plan + 1] = { key = "transfer_many100_guarded", mode = modes.transfer_many_guarded,
                    batch = 100, n = 3000 }
plan[#plan + 1] = { key = "transfer_many100_hot", mode = modes.transfer_many_guarded,
                    batch = 100, n = 3000, accounts = 10 }
for _, accounts in ipairs { 10, 10000 } do
  for _, procs in ipairs { 1, 2, 4, 8 } do
    plan[#plan + 1] = { key = ("procs%d_%d"):format(procs, accounts), mode = concurrent,
                        procs = procs, accounts = accounts, n = 800, runs = 3 }
  end
end
-- recovery of each kind, batched and one at a time (batch 1)
for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
  for _, batch in ipairs { 100, 1 } do
    plan[#plan + 1] = { key = ("recover_%s%d"):format(kind, batch), mode = modes["recover_" .. kind],
                        batch = batch, n = 10000, runs = 3 }
  end
end

local full = not opts.only and opts.scale == 1 and not opts.accounts

local function shell(cmd)
  local f = io.popen(cmd .. " 2>/dev/null")
  local s = f and f:read("*a") or ""
  if f then f:close() end
  return (s:gsub("%s+$", ""))
end

local machine = {
  cpus = shell("nproc"),
  model = shell("sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -1"),
  load_before = shell("cut -d' ' -f1-3 /proc/loadavg"),
  lua = type(jit) == "table" and jit.version or _VERSION,
  server = os.getenv("MONGOTX_TEST_SERVER") or "external",
  date = os.date("!%Y-%m-%d %H:%M UTC"),
}

-- Runs ----------------------------------------------------------------------

local results, failures = {}, 0
local started = os.time()
print(("bench: %s cores (%s), load %s, %s, server %s"):format(machine.cpus, machine.model,
  machine.load_before, machine.lua, machine.server))
for _, e in ipairs(plan) do
  if not opts.only or opts.only[e.key] then
    local n = math.max(math.floor(e.n * opts.scale + 0.5), e.batch or 1, e.procs or 1)
    local runs = opts.runs or e.runs or 5
    local ctx = { uri = uri, n = n, accounts = e.accounts or opts.accounts or 10000, batch = e.batch or 1,
                  procs = e.procs }
    io.write(("bench: %-18s %6d transfers x %d runs ..."):format(e.key, n, runs))
    io.flush()
    local t0 = os.time()
    local samples, status = {}, nil
    for _ = 1, runs do
      local ok, sample, why = pcall(e.mode.run, ctx)
      if not ok then
        status = "FAILED: " .. tostring(sample)
        failures = failures + 1
        break
      elseif not sample then
        status = why
        break
      end
      samples[#samples + 1] = sample
    end
    local r = { entry = e, ctx = ctx, status = status }
    if #samples > 0 and not status then r.sum = stats.summarise(samples) end
    results[#results + 1] = r
    print(r.sum and (" %.0f transfers/s (%ds)"):format(r.sum.tps, os.time() - t0) or (" " .. status))
  end
end
-- The server's cost per filter shape, for the profile (bench/filters.lua).
local filter_table = full and require("bench.filters").markdown(require("bench.filters").measure())
machine.load_after = shell("cut -d' ' -f1-3 /proc/loadavg")
machine.minutes = round((os.time() - started) / 60, 1)

-- The table -------------------------------------------------------------------

local by_key = {}
for _, r in ipairs(results) do by_key[r.entry.key] = r end
local raw = by_key.raw and by_key.raw.sum

local function fmt(x, d)
  if x == nil then return "" end
  return tostring(round(x, d or 0)):gsub("%.0$", "")
end

local function label(e)
  local s = e.mode.label
  if e.batch and e.batch > 1 or e.key:match("^commit_many") or e.key:match("^recover_") then
    s = s .. " (batch " .. e.batch .. ")"
  end
  if e.procs then s = ("%s %d on %d accounts"):format(s, e.procs, e.accounts)
  elseif e.accounts then s = ("%s on %d accounts"):format(s, e.accounts) end
  return s
end

local head = "| mode | transfers x runs | transfers/s median (min-max) | p50 ms | p99 ms | round trips" ..
  " / transfer | writes / transfer | round trips / call | client CPU µs / transfer | x raw |" ..
  " x bound (raw x 2/7) | failed |"
local rows = { head, "|" .. ("---|"):rep(12) }
for _, r in ipairs(results) do
  local s, e = r.sum, r.entry
  if s then
    rows[#rows + 1] = ("| %s | %d x %d | %s (%s-%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s |"):format(
      label(e), s.n, s.runs, fmt(s.tps), fmt(s.tps_min), fmt(s.tps_max), fmt(s.p50, 3), fmt(s.p99, 3),
      fmt(s.commands, 2), fmt(s.writes, 2), fmt(s.call_commands, 2), fmt(s.cpu_us),
      raw and fmt(s.tps / raw.tps, 3) or "", raw and fmt(s.tps / (raw.tps * BOUND), 2) or "",
      fmt(s.failed))
  else
    rows[#rows + 1] = ("| %s | %d | %s |%s"):format(label(e), r.ctx.n, r.status, (" |"):rep(9))
  end
end
local table_md = table.concat(rows, "\n")

-- The targets ---------------------------------------------------------------------

local function target_lines()
  local out = {}
  local cm, tb = by_key.commit_many100, by_key.textbook
  local function check(name, have, want, what)
    if not have then
      out[#out + 1] = ("- %s: **not measured** (%s)"):format(name, what)
    else
      out[#out + 1] = ("- %s: **%s** (%s; %s of the target)"):format(name,
        have >= want and "met" or "missed", what, fmt(100 * have / want) .. "%")
    end
  end
  local cm_tps = cm and cm.sum and cm.sum.tps
  local missing = cm and cm.status or "not run"
  check("commit_many at batch 100 ≥ 5 × textbook",
    cm_tps and tb and tb.sum and cm_tps / tb.sum.tps, 5,
    cm_tps and tb and tb.sum and ("%s / %s transfers/s = %s×"):format(fmt(cm_tps), fmt(tb.sum.tps),
      fmt(cm_tps / tb.sum.tps, 2)) or missing)
  check("commit_many at batch 100 ≥ 0.8 × bound (raw × 2/7)",
    cm_tps and raw and cm_tps / (raw.tps * BOUND), 0.8,
    cm_tps and raw and ("%s / (%s × 2/7 = %s) = %s"):format(fmt(cm_tps), fmt(raw.tps),
      fmt(raw.tps * BOUND), fmt(cm_tps / (raw.tps * BOUND), 2)) or missing)
  local best, parts = nil, {}
  for _, key in ipairs { "transfer", "transfer_deferred", "begin_commit" } do
    local r = by_key[key]
    if r and r.sum and r.sum.call_commands then
      parts[#parts + 1] = ("%s %s typical, %s on average"):format(label(r.entry),
        fmt(r.sum.typical_call_commands), fmt(r.sum.call_commands, 2))
      best = math.min(best or math.huge, r.sum.typical_call_commands)
    elseif r then
      parts[#parts + 1] = ("%s %s"):format(label(r.entry), r.status)
    end
  end
  out[#out + 1] = ("- a single commit returns after ≤ 3 round trips: **%s** (round trips per call, " ..
    "the most common count and the mean, which includes the first call's read of the server's clock " ..
    "and, deferred, the finisher every finish_batch calls: %s)")
    :format(best == nil and "not measured" or best <= 3 and "met" or "missed",
            table.concat(parts, "; "))
  -- batched recovery (issue 11): ≥ 4 × one at a time, ≥ 0.5 × commit_many@100
  for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
    local b, one = by_key["recover_" .. kind .. "100"], by_key["recover_" .. kind .. "1"]
    local btps, otps = b and b.sum and b.sum.tps, one and one.sum and one.sum.tps
    check(("recover %s at batch 100 ≥ 4 × batch 1"):format(kind), btps and otps and btps / otps, 4,
      btps and otps and ("%s / %s = %s×"):format(fmt(btps), fmt(otps), fmt(btps / otps, 2))
      or "not run")
    check(("recover %s at batch 100 ≥ 0.5 × commit_many at batch 100"):format(kind),
      btps and cm_tps and btps / cm_tps, 0.5,
      btps and cm_tps and ("%s / %s = %s×"):format(fmt(btps), fmt(cm_tps), fmt(btps / cm_tps, 2))
      or missing)
  end
  return table.concat(out, "\n")
end

local summary = table.concat({
  ("Measured %s in %s minutes: %s cores (%s), shared with three teammates running" ..
   " their tests, so the figures are noisy (load average %s before, %s after);" ..
   " %s; server: mongo-java-server %s on loopback, write concern %s;" ..
   " single-process modes on %d accounts."):format(
    machine.date, machine.minutes, machine.cpus, machine.model, machine.load_before,
    machine.load_after, machine.lua, machine.server, "{ w = \"majority\", j = true } for every mode",
    opts.accounts or 10000),
  "",
  table_md,
  "",
  "Targets:",
  "",
  target_lines(),
  filter_table and "\nServer time of one write by filter shape (median of 200, bench/filters.lua):\n\n" ..
    filter_table or "",
}, "\n")

print()
print(summary)

-- README and plot ---------------------------------------------------------------------

local function write_readme(text)
  local path = "bench/README.md"
  local f = assert(io.open(path, "rb"))
  local doc = f:read("*a")
  f:close()
  local open, close = "<!-- bench:results -->", "<!-- /bench:results -->"
  local a = assert(doc:find(open, 1, true), "no results marker in " .. path)
  local b = assert(doc:find(close, a, true), "no end marker in " .. path)
  doc = doc:sub(1, a + #open - 1) .. "\n" .. text .. "\n" .. doc:sub(b)
  f = assert(io.open(path, "wb"))
  f:write(doc)
  f:close()
end

local function plot()
  local data = os.tmpname()
  local f = assert(io.open(data, "w"))
  local x = 0
  for _, r in ipairs(results) do
    if r.sum then
      x = x + 1
      f:write(('%d "%s" %.3f %.3f %.3f\n'):format(x, r.entry.key, r.sum.tps, r.sum.tps_min, r.sum.tps_max))
    end
  end
  f:close()
  local cmd = ("gnuplot -e %s bench/plot.gp"):format(server.quote(("data='%s'; out='%s'; bound=%f; raw=%f")
    :format(data, "bench/throughput.png", raw and raw.tps * BOUND or 0, raw and raw.tps or 0)))
  local rc = server.execute(cmd)
  os.remove(data)
  assert(rc == 0, "gnuplot failed: " .. cmd)
end

if full then
  write_readme(summary)
  plot()
  print("\nbench: wrote the table to bench/README.md and the plot to bench/throughput.png")
end
if failures > 0 then
  io.stderr:write(("bench: %d mode(s) failed (an error, or a wrong database afterwards)\n"):format(failures))
  os.exit(1)
end
