-- Sections "sync" and "versioned": mongotx.sync and mongotx.versioned
-- under crashes, with the workloads and invariants of
-- spec/support/patterns.lua (children: spec/support/pattern_worker.lua).
--
-- 1. Their crash matrix, built like torture/crashpoints.lua's: a clean
--    run of each scenario lists the crash points it passes
--    (MONGOTX_FAULT_TRACE); then for each (point, before|after, nth time;
--    the first time only in --ci) a fresh database, a child that crashes
--    there, the module's repair in a fresh process (sync:repair / gc with
--    older_than = 0) and the final invariant.
-- 2. Random kills: 3 workers loop (renames / tree moves) with a repairer
--    process (older_than = 2 s) while the driver kill -9s a random worker
--    and starts another or (one time in four) stops one with SIGSTOP for
--    1-2 s; the running invariant is checked every poll, the final one
--    after a last repair in a fresh process.
-- mongo-java-server only (see torture/run.lua).

local proc = require "torture.proc"
local trace_points = require("torture.crashpoints").trace_points
local patterns = require "spec.support.patterns"
local helpers = require "spec.helpers"
local core = require "mongotx.core"

local M = {}

local WORKER = "spec/support/pattern_worker.lua"

-- The modules: their set-up, scenarios (pattern_worker.lua arguments
-- after <uri> <db>), the worker loop, and the invariants.
local modules = {
  sync = {
    setup = patterns.sync_setup, running = patterns.sync_running, final = patterns.sync_final,
    loop = "sync-loop",
    work = function(db)
      local n = 0
      for _, u in ipairs(assert(db:collection("users"):find_all({}))) do n = n + (u.syncSeq or 0) end
      return ("%d renames"):format(n)
    end,
    scenarios = {
      { name = "rename", mode = "sync-rename", args = { "u1", "Gus", "-", "-" } },
      { name = "rename-failing", mode = "sync-rename", args = { "u1", "Gus", "raise", "-" } },
    },
  },
  versioned = {
    setup = patterns.versioned_setup, running = patterns.versioned_running,
    final = patterns.versioned_final,
    loop = "versioned-loop",
    work = function(db)
      local r = assert(db:collection("trees"):find_one({ _id = patterns.ROOT }))
      return ("%d versions taken, published up to %d, %d dead"):format(r.next, r.version, #r.dead)
    end,
    scenarios = {
      { name = "new-root", mode = "versioned-new", args = { "-" } },
      { name = "move", mode = "versioned-move", args = { "-" } },
      { name = "race", mode = "versioned-race", args = { "-" } },
    },
  },
}

-- Runs pattern_worker.lua mode uri db args... with env; its status class
-- and output.
local function run_child(env, mode, uri, dbname, args, seconds)
  local argv = { mode, uri, dbname }
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  local c = proc.spawn(argv, env, WORKER)
  local rc = proc.wait(c, seconds or 60)
  local out = proc.output(c)
  proc.cleanup(c)
  return rc and proc.classify(rc) or "hung", out
end

local counter = 0
local function fresh_db(ctx, name, mod)
  counter = counter + 1
  local dbname = ("pt%d_%s"):format(counter, name:gsub("%W", ""))
  mod.setup(patterns.db(ctx.uri, dbname))
  return dbname
end

-- One case: returns nil, or a failure line.
local function crash_case(ctx, which, mod, s, fault, result)
  local dbname = fresh_db(ctx, which .. s.name, mod)
  local how, out = run_child(fault and { MONGOTX_FAULT = fault } or nil, s.mode, ctx.uri,
    dbname, s.args)
  if how == "injected" then result.injected = result.injected + 1
  elseif fault and how == "ok" then result.missed = result.missed + 1 end
  if how ~= "ok" and how ~= "injected" then
    result.crashes = result.crashes + 1
    return ("%s %s: child %s: %s"):format(s.name, tostring(fault), how, out)
  end
  local db = patterns.db(ctx.uri, dbname)
  local bad = mod.running(db)
  local rhow, rout = run_child(nil, "repair", ctx.uri, dbname, { which })
  if rhow ~= "ok" then
    result.crashes = result.crashes + 1
    return ("%s %s: repair %s: %s"):format(s.name, tostring(fault), rhow, rout)
  end
  for _, v in ipairs(mod.final(db)) do bad[#bad + 1] = v end
  if #bad > 0 then
    result.violations = result.violations + #bad
    return ("%s %s (db %s): %s"):format(s.name, tostring(fault), dbname, table.concat(bad, "; "))
  end
  db.client:command(dbname, { dropDatabase = 1 })
end

local function crash_matrix(ctx, which, mod, result)
  for _, s in ipairs(mod.scenarios) do
    local started = core.monotonic_ms()
    local trace = os.tmpname()
    local dbname = fresh_db(ctx, which .. s.name, mod)
    run_child({ MONGOTX_FAULT_TRACE = trace }, s.mode, ctx.uri, dbname, s.args)
    local points = trace_points(trace)
    os.remove(trace)
    local n = 0
    for _, p in ipairs(points) do
      if ctx.full or p:match(":1$") then
        n = n + 1
        result.cases = result.cases + 1
        local failure = crash_case(ctx, which, mod, s, p, result)
        if failure then result.failures[#result.failures + 1] = failure end
      end
    end
    ctx.say("  %s crashpoints %-15s %3d points %5.1f s", which, s.name, n,
      (core.monotonic_ms() - started) / 1000)
  end
end

local function kills(ctx, which, mod, result)
  local seconds = ctx.seconds or (ctx.full and 120 or 15)
  local dbname = fresh_db(ctx, which .. "kills", mod)
  local db = patterns.db(ctx.uri, dbname)
  local stop = os.tmpname()
  os.remove(stop)
  local live = {}
  local function spawn()
    live[#live + 1] = proc.spawn({ mod.loop, ctx.uri, dbname, stop }, nil, WORKER)
  end
  for _ = 1, ctx.workers or 3 do spawn() end
  local repairer = proc.spawn({ "repair", ctx.uri, dbname, which, stop }, nil, WORKER)
  local killed, stops, polls, seen, notes = 0, 0, 0, {}, 0
  local finish = core.monotonic_ms() + seconds * 1000
  while core.monotonic_ms() < finish do
    core.sleep(0.2 + math.random() * 0.6)
    local i = math.random(#live)
    if math.random(4) == 1 then
      helpers.signal(live[i].pid, "STOP")
      core.sleep(1 + math.random())
      helpers.signal(live[i].pid, "CONT")
      stops = stops + 1
    else
      helpers.signal(live[i].pid, "KILL")
      proc.wait(live[i], 10)
      proc.cleanup(live[i])
      table.remove(live, i)
      killed = killed + 1
      spawn()
    end
    polls = polls + 1
    local bad, noted = mod.running(db)
    notes = notes + #(noted or {})
    for _, v in ipairs(bad) do
      if not seen[v] then
        seen[v] = true
        result.violations = result.violations + 1
        result.failures[#result.failures + 1] = which .. " kills (running): " .. v
      end
    end
  end
  local f = assert(io.open(stop, "w"))
  f:close()
  for _, c in ipairs(live) do
    local how = proc.wait(c, 60)
    if how ~= 0 then
      result.crashes = result.crashes + 1
      result.failures[#result.failures + 1] = ("%s kills: worker %s: %s"):format(which,
        tostring(how), proc.output(c))
    end
    proc.cleanup(c)
  end
  proc.wait(repairer, 60)
  proc.cleanup(repairer)
  os.remove(stop)
  local rhow, rout = run_child(nil, "repair", ctx.uri, dbname, { which })
  if rhow ~= "ok" then
    result.crashes = result.crashes + 1
    result.failures[#result.failures + 1] = which .. " kills: final repair " .. rhow .. ": " .. rout
  end
  for _, v in ipairs(mod.final(db)) do
    result.violations = result.violations + 1
    result.failures[#result.failures + 1] = which .. " kills (final): " .. v
  end
  result.cases = result.cases + 1
  return ("%d s, %d kills, %d stops, %d polls (%d half-applied-read notes), %s"):format(
    seconds, killed, stops, polls, notes, mod.work(db))
end

local function section(which)
  return function(ctx)
    local mod = modules[which]
    local result = { cases = 0, violations = 0, crashes = 0, injected = 0, missed = 0,
                     failures = {} }
    crash_matrix(ctx, which, mod, result)
    local k = kills(ctx, which, mod, result)
    result.notes = ("%d injected crashes, %d points not reached; kills: %s"):format(
      result.injected, result.missed, k)
    ctx.say("  %s: %s", which, result.notes)
    return result
  end
end

M.sync, M.versioned = section("sync"), section("versioned")

return M
