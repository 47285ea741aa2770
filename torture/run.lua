-- The torture suite's driver (TESTING.md): runs the sections, prints a
-- summary table `section | cases | violations | crashes | notes` and exits
-- non-zero when any section found a violation, a crash or could not run.
--
--   lua5.4 torture/run.lua [--ci] [--only name,name...] [--seconds n] [--workers n]
--                          [--scenarios name,name...]
--
-- --ci is the bounded run of `make torture-ci`; the default is the full
-- run of `make torture`.  --seconds and --workers replace the length and
-- the number of workers of the random runs (kills, random stalls), for
-- measurements such as TESTING.md's before/after figures; --scenarios
-- runs only those scenarios of the crash matrix.  Sections (each starts its own servers):
--   crashpoints-memory, crashpoints-ferretdb   torture/crashpoints.lua
--   kills        random kill -9 of workers      torture/kills.lua
--   mixed        the same, managers configured differently (issue 27)
--   races        fixed two-manager interleavings torture/races.lua
--   stalls       SIGSTOP past the lease          torture/stalls.lua
--   queue-crashpoints, queue-kills   mongotx.queue's crash matrix and its
--                random kill -9 / SIGSTOP run   torture/queue.lua
--   ledger       mongotx.ledger: its crash points, then random kill -9 of
--                workers moving money with min = 0  torture/ledger.lua
--   holds        holds, captures, voids, expiries and transfers on one hot
--                account under random kill -9    torture/holds.lua
--   server       server kill -9, durability, connection drop
--                                                torture/server_faults.lua
--   sync, versioned  mongotx.sync / mongotx.versioned: their crash
--                matrix and random kills      torture/patterns.lua
--   batchjob     examples/06 killed and re-run   torture/batchjob.lua
--   hostile      busted spec/30-hostile_spec.lua (a teammate's)
--   fuzz         make fuzz-ci (a teammate's)
-- The concurrent sections (kills, stalls) run on mongo-java-server only:
-- FerretDB v1 does not isolate concurrent read-modify-writes of one
-- document (FerretDB issue #3040).

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local server = require "spec.support.server"
local core = require "mongotx.core"
local proc = require "torture.proc"
require "torture.fencing"

local full, only, seconds, workers, scenarios = true, nil, nil, nil, nil
do
  local i = 1
  while arg[i] do
    if arg[i] == "--ci" then full = false
    elseif arg[i] == "--only" then
      i = i + 1
      only = {}
      for name in (arg[i] or ""):gmatch("[^,]+") do only[name] = true end
    elseif arg[i] == "--scenarios" then
      i = i + 1
      scenarios = {}
      for name in (arg[i] or ""):gmatch("[^,]+") do scenarios[name] = true end
    elseif (arg[i] == "--seconds" or arg[i] == "--workers") and tonumber(arg[i + 1]) then
      if arg[i] == "--seconds" then seconds = tonumber(arg[i + 1]) else
        workers = math.floor(tonumber(arg[i + 1])) end
      i = i + 1
    else
      io.stderr:write("usage: torture/run.lua [--ci] [--only section,...] [--seconds n] "
        .. "[--workers n] [--scenarios name,...]\n")
      os.exit(2)
    end
    i = i + 1
  end
end

local function say(fmt, ...)
  io.stdout:write(fmt:format(...), "\n")
  io.stdout:flush()
end

-- Runs fn(ctx) with a fresh server of `kind` (nil: no server).
local function with_server(kind, fn)
  local ctx = { full = full, say = say, server = kind, seconds = seconds, workers = workers,
                scenarios = scenarios }
  local s
  if kind then
    local err
    s, err = server.start { kind = kind }
    if not s then return { cases = 0, violations = 0, crashes = 0, failed = "no server: " .. err } end
    ctx.uri, ctx.started = s.uri, s
  end
  proc.single_writer = kind == "ferretdb"
  local ok, res = pcall(fn, ctx)
  proc.single_writer = false
  if s then s:stop() end
  if not ok then return { cases = 0, violations = 0, crashes = 0, failed = tostring(res) } end
  return res
end

local sections = {
  { name = "crashpoints-memory", run = function()
      return with_server("memory", require("torture.crashpoints").run) end },
  { name = "crashpoints-ferretdb", run = function()
      return with_server("ferretdb", require("torture.crashpoints").run) end },
  { name = "kills", run = function()
      return with_server("memory", require("torture.kills").run) end },
  { name = "mixed", run = function()
      return with_server("memory", require("torture.kills").mixed) end },
  { name = "races", run = function()
      return with_server("memory", require("torture.races").run) end },
  { name = "stalls", run = function()
      return with_server("memory", require("torture.stalls").run) end },
  { name = "queue-crashpoints", run = function()
      return with_server("memory", require("torture.queue").crashpoints) end },
  { name = "queue-kills", run = function()
      return with_server("memory", require("torture.queue").kills) end },
  { name = "ledger", run = function()
      return with_server("memory", require("torture.ledger").run) end },
  { name = "holds", run = function()
      return with_server("memory", require("torture.holds").run) end },
  { name = "server", run = function()
      return with_server(nil, require("torture.server_faults").run) end },
  { name = "sync", run = function()
      return with_server("memory", require("torture.patterns").sync) end },
  { name = "versioned", run = function()
      return with_server("memory", require("torture.patterns").versioned) end },
  { name = "batchjob", run = function()
      return with_server("memory", require("torture.batchjob").run) end },
  { name = "hostile", run = function()
      return with_server(nil, require("torture.external").hostile) end },
  { name = "fuzz", run = function()
      return with_server(nil, require("torture.external").fuzz) end },
}

-- the teammates' suites run as CI targets of their own: only here in full
local FULL_ONLY = { hostile = true, fuzz = true }

local rows, bad = {}, 0
local t0 = core.monotonic_ms()
for _, sec in ipairs(sections) do
  if (only and only[sec.name]) or (not only and (full or not FULL_ONLY[sec.name])) then
    say("== %s (%s)", sec.name, full and "full" or "ci")
    local started = core.monotonic_ms()
    local r = sec.run()
    r.seconds = (core.monotonic_ms() - started) / 1000
    for _, line in ipairs(r.failures or {}) do say("  FAIL %s", line) end
    if r.failed then say("  FAILED: %s", r.failed) end
    if r.failed or r.violations > 0 or r.crashes > 0 then bad = bad + 1 end
    rows[#rows + 1] = { sec.name, r }
  end
end

say("")
say("== torture summary (%s, %.0f s)", full and "full" or "ci", (core.monotonic_ms() - t0) / 1000)
say("%-22s | %6s | %10s | %7s | %6s | %s", "section", "cases", "violations", "crashes", "secs",
  "notes")
for _, row in ipairs(rows) do
  local r = row[2]
  say("%-22s | %6d | %10d | %7d | %6.0f | %s", row[1], r.cases, r.violations, r.crashes,
    r.seconds, r.failed and ("FAILED: " .. r.failed:gsub("\n.*", "")) or (r.notes or ""))
end
say("%d of %d sections failed", bad, #rows)
os.exit(bad == 0 and 0 or 1)
