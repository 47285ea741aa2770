-- bench/run.lua: the driver of `make bench`.  Runs every mode against the
-- server in MONGOTX_TEST_URI (spec/support/with-server starts one), each
-- several times on a fresh database, prints the medians as a table and,
-- for a full run, writes that table into bench/results.md (between its
-- results markers) and plots bench/throughput.png with gnuplot.
--
--   lua5.4 bench/run.lua [--runs N] [--scale F] [--only key,key...] [--loopback-only]
--                        [--fencing auto|deadline|version]
--
--   --runs   runs per mode (default 5; 3 for commit_many at batch 1000, the
--            recovery and the process modes)
--   --scale  multiplies every transfer count (default 1; e.g. 0.1 to try it)
--   --only   run these modes only (keys as printed); results.md and plot are
--            left alone unless the run is full (no --only, scale 1, no
--            --accounts)
--   --accounts  accounts of the single-process modes (default 10 000; at
--            least twice the largest batch run)
--   --loopback-only  no rows through toxiproxy (bench/latency.lua)
--   --fencing  the managers' fencing in the process rows (default "auto";
--            "version" is FerretDB v2's path, where $$NOW is refused in writes)
--
-- The rows marked `latency = true` also run through toxiproxy at each of
-- latency.LEVELS (keys like raw@1ms), after the loopback rows, with
-- transfers scaled so that a run takes about LEVEL_SECONDS.
--
-- Exits non-zero when a mode's check of the database failed.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local modes = require "bench.modes"
local holds = require "bench.holds"
local concurrent = require "bench.concurrent"
local stats = require "bench.stats"
local server = require "spec.support.server"
local latency = require "bench.latency"

local round = stats.round
local BOUND = 2 / 7 -- writes of a raw transfer over the protocol's minimum

local opts = { runs = nil, scale = 1, only = nil, accounts = nil, loopback_only = false,
               fencing = "auto" }
do
  local i = 1
  while arg[i] do
    local a, v = arg[i], arg[i + 1]
    if a == "--loopback-only" then
      opts.loopback_only = true
      i = i + 1
    else
      if a == "--runs" then opts.runs = assert(tonumber(v), "--runs N")
      elseif a == "--scale" then opts.scale = assert(tonumber(v), "--scale F")
      elseif a == "--accounts" then opts.accounts = assert(tonumber(v), "--accounts N")
      elseif a == "--fencing" then
        assert(v == "auto" or v == "deadline" or v == "version", "--fencing auto|deadline|version")
        opts.fencing = v
      elseif a == "--only" then
        opts.only = {}
        for k in v:gmatch("[^,]+") do opts.only[k] = true end
      else error("unknown argument " .. a) end
      i = i + 2
    end
  end
end

local uri = assert(os.getenv("MONGOTX_TEST_URI"),
  "MONGOTX_TEST_URI is not set: run through `make bench` or spec/support/with-server")

-- What runs, in order.  n is the transfers per run (before --scale);
-- latency = true: the row runs at every latency level too.
local plan = {
  { key = "raw", mode = modes.raw, n = 5000, latency = true },
  { key = "textbook", mode = modes.textbook, n = 1000, latency = true },
  { key = "transfer", mode = modes.transfer, n = 1000, latency = true },
  { key = "transfer_guarded", mode = modes.transfer_guarded, n = 1000 },
  { key = "transfer_deferred", mode = modes.transfer_deferred, n = 1000, latency = true },
  { key = "begin_commit", mode = modes.begin_commit, n = 1000 },
}
-- (counts chosen so that `make bench` stays near 15 minutes on 2 cores)
for _, b in ipairs { { 1, 1000, 5 }, { 10, 1000, 5 }, { 100, 3000, 5 }, { 1000, 5000, 3 } } do
  plan[#plan + 1] = { key = "commit_many" .. b[1], mode = modes.commit_many, batch = b[1], n = b[2],
                      runs = b[3], latency = b[1] > 1 }
end
plan[#plan + 1] = { key = "transfer_many100", mode = modes.transfer_many, batch = 100, n = 3000 }
-- mongotx.ledger beside them (issue 12): one entry per transfer
plan[#plan + 1] = { key = "ledger", mode = modes.ledger, n = 1000 }
plan[#plan + 1] = { key = "ledger_many100", mode = modes.ledger_many, batch = 100, n = 3000 }
-- holds (issue 44): a hold and its capture per transfer, on 10 000
-- accounts and from one account that holds 10 000 open holds
plan[#plan + 1] = { key = "hold_capture", mode = holds.hold_capture, n = 1000 }
plan[#plan + 1] = { key = "hold_many100_capture", mode = holds.hold_many_capture, batch = 100,
                    n = 1000 }
plan[#plan + 1] = { key = "hold_capture_open", mode = holds.hold_capture_open, n = 200,
                    open = 10000, runs = 3 }
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
-- hot accounts (issue 33): 4 and 8 processes, every transfer guarded
-- (min = 0), on 3 accounts against the same load on 1 000
for _, procs in ipairs { 4, 8 } do
  for _, accounts in ipairs { 3, 1000 } do
    plan[#plan + 1] = { key = ("procs%d_guarded_%d"):format(procs, accounts), mode = concurrent,
                        procs = procs, accounts = accounts, min = 0, n = 1600, runs = 3 }
  end
end
-- hot $set (issue 39): 4 processes, each transaction $sets two random
-- documents of 5 (exclusive: they wait for each other) against 1 000,
-- for `set` seconds (scaled like n)
for _, accounts in ipairs { 5, 1000 } do
  plan[#plan + 1] = { key = ("procs4_set_%d"):format(accounts), mode = concurrent,
                      procs = 4, accounts = accounts, set = 20, n = 1000, runs = 3 }
end
-- recovery of each kind, batched and one at a time (batch 1), with
-- their latency rows: what batching recovery is for
for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
  for _, batch in ipairs { 100, 1 } do
    plan[#plan + 1] = { key = ("recover_%s%d"):format(kind, batch), mode = modes["recover_" .. kind],
                        batch = batch, n = 10000, runs = 3, latency = true }
  end
end

-- A latency row's run aims at this many seconds (the loopback row's time
-- per transfer plus its round trips at the measured round trip); its runs
-- default to 3.
local LEVEL_SECONDS = 2
local LEVEL_RUNS = 3
local PINGS = 500 -- ping commands timed to measure a level's round trip

local full = not opts.only and opts.scale == 1 and not opts.accounts and not opts.loopback_only

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
local by_key = {}
local started = os.time()
print(("bench: %s cores (%s), load %s, %s, server %s"):format(machine.cpus, machine.model,
  machine.load_before, machine.lua, machine.server))

-- Runs plan entry e (n transfers a run) against the server of uri.
local function run_row(e, n, runs, row_uri)
  local ctx = { uri = row_uri, n = n, accounts = e.accounts or opts.accounts or 10000, batch = e.batch or 1,
                procs = e.procs, min = e.min, set = e.set and e.set * n / e.n, fencing = opts.fencing,
                open = e.open and math.floor(e.open * opts.scale + 0.5) }
  io.write(("bench: %-24s %6d transfers x %d runs ..."):format(e.key, n, runs))
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
  by_key[e.key] = r
  print(r.sum and (" %.0f transfers/s (%ds)"):format(r.sum.tps, os.time() - t0) or (" " .. status))
end

local function min_n(e)
  return math.max(e.batch or 1, e.procs or 1)
end

-- Warm-up: untimed runs of every selected row at a fifth of its
-- transfers, round after round until WARM_SECONDS have passed, before
-- anything is timed.  mongo-java-server runs in a JVM whose JIT compiles
-- the server's paths during its first seconds under load; without this
-- the first rows (raw, textbook) ran on a cold server with the compiler
-- threads taking the cores (raw's server CPU per transfer: 262 µs in the
-- first second, 120 after 5 s, 75-95 after 10 s).
local WARM_SECONDS = 15
local function warm_up(e, n)
  local ctx = { uri = uri, n = math.max(math.floor(n / 5), min_n(e)), accounts = e.accounts
                or opts.accounts or 10000, batch = e.batch or 1, procs = e.procs, min = e.min,
                open = e.open and math.floor(e.open / 50), fencing = opts.fencing }
  ctx.set = e.set and e.set * ctx.n / e.n
  pcall(e.mode.run, ctx) -- a failure shows in the timed runs
end

local selected = {}
for _, e in ipairs(plan) do
  if not opts.only or opts.only[e.key] then selected[#selected + 1] = e end
end
if #selected > 0 then
  io.write(("bench: warming the server up (every row, untimed, for %d s) ..."):format(WARM_SECONDS))
  io.flush()
  local t0, rounds = os.time(), 0
  repeat
    for _, e in ipairs(selected) do warm_up(e, math.floor(e.n * opts.scale + 0.5)) end
    rounds = rounds + 1
  until os.time() - t0 >= WARM_SECONDS
  print((" %d rounds, %ds"):format(rounds, os.time() - t0))
end
for _, e in ipairs(selected) do
  run_row(e, math.max(math.floor(e.n * opts.scale + 0.5), min_n(e)), opts.runs or e.runs or 5, uri)
end

-- The latency levels: the marked rows again through toxiproxy.  A row's
-- transfers: what takes LEVEL_SECONDS at the loopback row's time per
-- transfer plus its round trips at the level's measured round trip (at
-- most the loopback count; a tenth of it when loopback did not run).
local pings = {} -- level key ("direct", "loopback", "0.2ms", "1ms") -> { median, mean }
local function at_levels()
  local wanted = {}
  for _, level in ipairs(latency.LEVELS) do
    for _, e in ipairs(plan) do
      local key = e.key .. "@" .. level.key
      if e.latency and (not opts.only or opts.only[key]) then wanted[#wanted + 1] = { e, level, key } end
    end
  end
  if #wanted == 0 then return end
  local proxy, err = latency.start(uri)
  if not proxy then
    failures = failures + 1
    io.stderr:write("bench: ", err, " (--loopback-only runs without toxiproxy)\n")
    return
  end
  print(("bench: toxiproxy %s in front of the server at %s"):format(proxy.version, proxy.uri))
  local direct = assert(latency.ping(uri, PINGS))
  pings.direct = direct
  proxy:set(nil)
  pings.loopback = latency.ping(proxy.uri, PINGS)
  print(("bench: ping round trip, median/mean ms: direct %.3f/%.3f, through toxiproxy %.3f/%.3f")
    :format(direct.median, direct.mean, pings.loopback.median, pings.loopback.mean))
  local current
  for _, w in ipairs(wanted) do
    local e, level, key = w[1], w[2], w[3]
    if current ~= level then
      current = level
      proxy:set(level)
      pings[level.key] = latency.ping(proxy.uri, PINGS)
      print(("bench: latency %s: ping round trip median %.3f ms, mean %.3f ms"):format(level.label,
        pings[level.key].median, pings[level.key].mean))
    end
    local base, n = by_key[e.key], e.n * 0.1
    if base and base.sum then
      local per_s = 1 / base.sum.tps + base.sum.commands * pings[level.key].mean / 1000
      n = math.min(e.n, LEVEL_SECONDS / per_s)
    end
    local entry = setmetatable({ key = key, level = level }, { __index = e })
    run_row(entry, math.max(math.floor(n * opts.scale + 0.5), min_n(e)), opts.runs or LEVEL_RUNS, proxy.uri)
  end
  proxy:stop()
end
if not opts.loopback_only then at_levels() end

-- The server's cost per filter shape, for the profile (bench/filters.lua).
local filter_table = full and require("bench.filters").markdown(require("bench.filters").measure())
machine.load_after = shell("cut -d' ' -f1-3 /proc/loadavg")
machine.minutes = round((os.time() - started) / 60, 1)

-- The table -------------------------------------------------------------------

local function fmt(x, d)
  if x == nil then return "" end
  return tostring(round(x, d or 0)):gsub("%.0$", "")
end

local function label(e)
  local s = e.mode.label
  if e.batch and e.batch > 1 or e.key:match("^commit_many") or e.key:match("^recover_") then
    s = s .. " (batch " .. e.batch .. ")"
  end
  if e.set then
    s = ("tm:run of $set pairs, processes %d on %d documents"):format(e.procs, e.accounts)
  elseif e.procs then
    s = ("%s %d on %d accounts"):format(s, e.procs, e.accounts) .. (e.min and ", min = " .. e.min or "")
  elseif e.accounts then s = ("%s on %d accounts"):format(s, e.accounts) end
  if e.level then s = ("%s, +%s"):format(s, e.level.label) end
  return s
end

-- The summary of `key`'s row at `level` (nil: loopback), and the row.
local function at(key, level)
  local r = by_key[level and key .. "@" .. level.key or key]
  return r and r.sum, r
end

local head = "| mode | transfers x runs | transfers/s median (min-max) | p50 ms | p99 ms | round trips" ..
  " / transfer | writes / transfer | round trips / call | client CPU µs / transfer |" ..
  " server CPU µs / transfer | x raw |" ..
  " x bound (raw x 2/7) | failed |"
local rows = { head, "|" .. ("---|"):rep(13) }
for _, r in ipairs(results) do
  local s, e = r.sum, r.entry
  local raw = at("raw", e.level)
  if s then
    rows[#rows + 1] = ("| %s | %d x %d | %s (%s-%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"):format(
      label(e), s.n, s.runs, fmt(s.tps), fmt(s.tps_min), fmt(s.tps_max), fmt(s.p50, 3), fmt(s.p99, 3),
      fmt(s.commands, 2), fmt(s.writes, 2), fmt(s.call_commands, 2), fmt(s.cpu_us), fmt(s.server_us),
      raw and fmt(s.tps / raw.tps, 3) or "", raw and fmt(s.tps / (raw.tps * BOUND), 2) or "",
      fmt(s.failed))
  else
    rows[#rows + 1] = ("| %s | %d | %s |%s"):format(label(e), r.ctx.n, r.status, (" |"):rep(10))
  end
end
local table_md = table.concat(rows, "\n")

-- The targets ---------------------------------------------------------------------

local function target_lines()
  local out = {}
  local function check(name, have, want, what)
    if not have then
      out[#out + 1] = ("- %s: **not measured** (%s)"):format(name, what)
    else
      out[#out + 1] = ("- %s: **%s** (%s; %s of the target)"):format(name,
        have >= want and "met" or "missed", what, fmt(100 * have / want) .. "%")
    end
  end
  -- throughput of `key` ≥ want × that of `base`, both at `level`
  local function ratio(key, base, want, level)
    local a, ra = at(key, level)
    local b, rb = at(base, level)
    local at_level = level and ", +" .. level.label or ""
    local name = ("%s ≥ %s × %s"):format(ra and label(ra.entry) or key .. at_level, want,
      rb and label(rb.entry) or base .. at_level)
    if not (a and b) then
      return check(name, nil, want, (ra or rb) and (ra or rb).status or "not run")
    end
    check(name, a.tps / b.tps, want, ("%s / %s transfers/s = %s×"):format(fmt(a.tps), fmt(b.tps),
      fmt(a.tps / b.tps, 2)))
  end
  ratio("commit_many100", "textbook", 5)
  ratio("commit_many100", "raw", 1.5)
  ratio("transfer", "textbook", 1.3)
  local raw = at("raw")
  local cm_tps = at("commit_many100") and at("commit_many100").tps
  local missing = by_key.commit_many100 and by_key.commit_many100.status or "not run"
  check("commit_many at batch 100 ≥ 0.8 × bound (raw × 2/7)",
    cm_tps and raw and cm_tps / (raw.tps * BOUND), 0.8,
    cm_tps and raw and ("%s / (%s × 2/7 = %s) = %s"):format(fmt(cm_tps), fmt(raw.tps),
      fmt(raw.tps * BOUND), fmt(cm_tps / (raw.tps * BOUND), 2)) or missing)
  ratio("ledger", "transfer", 2) -- issue 12: one inserted entry against 2PC
  -- hot accounts (issue 33): guarded transfers on 3 accounts at ≥ 0.8 x
  -- their rate on 1 000, none answered busy or contention
  ratio("procs4_guarded_3", "procs4_guarded_1000", 0.8)
  local hot = at("procs4_guarded_3")
  out[#out + 1] = ("- guarded transfers on 3 hot accounts answer no `busy` or `contention`: **%s** (%s)"):format(
    not hot and "not measured" or hot.busy_max == 0 and "met" or "missed",
    hot and ("%d runs: at most %s busy or contention; failed, median: %s of %d"):format(hot.runs,
      fmt(hot.busy_max), fmt(hot.failed), hot.n) or "not run")
  -- hot $set (issue 39): every transaction ends (the run's check), the
  -- share done and the rate on 5 documents against 1 000
  local hs, cs = at("procs4_set_5"), at("procs4_set_1000")
  out[#out + 1] = ("- `$set` pairs on 5 hot documents, 4 processes: %s"):format(hs and cs
    and ("%s done/s (%s %% done, %s busy at most) against %s on 1 000 (%s %% done): %s×"):format(
      fmt(hs.tps), fmt(100 * (hs.n - hs.failed) / hs.n), fmt(hs.busy_max), fmt(cs.tps),
      fmt(100 * (cs.n - cs.failed) / cs.n), fmt(hs.tps / cs.tps, 2)) or "not run")
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
  local one_ms = latency.LEVELS[#latency.LEVELS]
  ratio("commit_many100", "textbook", 50, one_ms)
  ratio("commit_many100", "raw", 10, one_ms)
  -- wall time of one deferred tm:transfer (p50) in measured round trips
  -- (the median ping: a level's mean moves with the machine's stalls)
  local d, ping = at("transfer_deferred", one_ms), pings[one_ms.key]
  check("a single tm:transfer deferred, +" .. one_ms.label .. ", within 3.2 round trips of wall time",
    d and ping and 3.2 / (d.p50 / ping.median), 1,
    d and ping and ("p50 %s ms over a measured round trip (median ping) of %s ms = %s round trips")
      :format(fmt(d.p50, 3), fmt(ping.median, 3), fmt(d.p50 / ping.median, 2)) or "not run")
  -- batched recovery (issue 11): ≥ 4 × one at a time, ≥ 0.5 × commit_many
  -- at batch 100, on loopback and at +1 ms
  for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
    ratio("recover_" .. kind .. "100", "recover_" .. kind .. "1", 4)
    ratio("recover_" .. kind .. "100", "commit_many100", 0.5)
  end
  for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
    ratio("recover_" .. kind .. "100", "recover_" .. kind .. "1", 4, one_ms)
    ratio("recover_" .. kind .. "100", "commit_many100", 0.5, one_ms)
  end
  return table.concat(out, "\n")
end

-- What the pings measured (bench/latency.lua).
local function ping_line()
  if not pings.direct then return "" end
  local parts = { ("direct %s / %s"):format(fmt(pings.direct.median, 3), fmt(pings.direct.mean, 3)),
                  ("through toxiproxy without toxics %s / %s"):format(fmt(pings.loopback.median, 3),
                    fmt(pings.loopback.mean, 3)) }
  for _, level in ipairs(latency.LEVELS) do
    local p = pings[level.key]
    if p then parts[#parts + 1] = ("+%s %s / %s"):format(level.label, fmt(p.median, 3), fmt(p.mean, 3)) end
  end
  return ("\nRound trip of a `ping` command, median / mean ms of %d (the +latency rows run through"):format(PINGS) ..
    " toxiproxy, bench/latency.lua): " .. table.concat(parts, "; ") .. ".\n"
end

local summary = table.concat({
  ("Measured %s in %s minutes: %s cores (%s), shared with three teammates running" ..
   " their tests, so the figures are noisy (load average %s before, %s after);" ..
   " %s; server: mongo-java-server %s on loopback, write concern %s;" ..
   " single-process modes on %d accounts."):format(
    machine.date, machine.minutes, machine.cpus, machine.model, machine.load_before,
    machine.load_after, machine.lua, machine.server, "{ w = \"majority\", j = true } for every mode",
    opts.accounts or 10000),
  ping_line(),
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

-- results.md and plot -----------------------------------------------------------------

local function write_readme(text)
  local path = "bench/results.md"
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

-- One line per latency (loopback first), one column per mode that runs at
-- every latency, then the bound: raw's transfers/s at that latency × 2/7.
local function plot()
  local levels = { false }
  for _, level in ipairs(latency.LEVELS) do levels[#levels + 1] = level end
  local keys, titles = {}, { '"round trip"' }
  for _, e in ipairs(plan) do
    if e.latency and at(e.key) then
      keys[#keys + 1] = e.key
      titles[#titles + 1] = ("%q"):format(label(e))
    end
  end
  titles[#titles + 1] = '"7-writes bound (raw x 2/7)"'
  local data = os.tmpname()
  local f = assert(io.open(data, "w"))
  f:write(table.concat(titles, " "), "\n")
  for _, level in ipairs(levels) do
    local line = { ("%q"):format(level and "+" .. level.label or "loopback") }
    for _, key in ipairs(keys) do
      local s = at(key, level or nil)
      line[#line + 1] = s and ("%.3f"):format(s.tps) or "?"
    end
    local raw = at("raw", level or nil)
    line[#line + 1] = raw and ("%.3f"):format(raw.tps * BOUND) or "?"
    f:write(table.concat(line, " "), "\n")
  end
  f:close()
  local cmd = ("gnuplot -e %s bench/plot.gp"):format(server.quote(("data='%s'; out='%s'; cols=%d")
    :format(data, "bench/throughput.png", #titles)))
  local rc = server.execute(cmd)
  os.remove(data)
  assert(rc == 0, "gnuplot failed: " .. cmd)
end

if full then
  write_readme(summary)
  plot()
  print("\nbench: wrote the table to bench/results.md and the plot to bench/throughput.png")
end
if failures > 0 then
  io.stderr:write(("bench: %d mode(s) failed (an error, or a wrong database afterwards)\n"):format(failures))
  os.exit(1)
end
