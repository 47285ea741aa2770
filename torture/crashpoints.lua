-- Section 1, the crash matrix.  For every scenario of torture/scenarios.lua
-- and each of its op kinds: a clean run lists the crash points it passes
-- (MONGOTX_FAULT_TRACE, so the matrix follows the engine as it changes);
-- then, for each (point, before|after, nth time), a fresh database, a
-- child that crashes exactly there (MONGOTX_FAULT, _exit without clean-up)
-- and, once all cases ran, one fresh process that recovers every database.
-- torture/check.lua then checks each database, and the matrix of final
-- states of transaction T (done / cancelled / absent, or VIOLATION) is
-- printed per scenario.

local proc = require "torture.proc"
local check = require "torture.check"
local scenarios = require "torture.scenarios"
local core = require "mongotx.core"

local M = {}

-- The cases a trace file lists: "<point>:<when>:<nth time>" per line.
local function trace_points(path)
  local seen, list = {}, {}
  local f = io.open(path)
  if not f then return list end
  for line in f:lines() do
    local point, when = line:match("^(%S+) (%S+)$")
    if point then
      local k = point .. ":" .. when
      seen[k] = (seen[k] or 0) + 1
      list[#list + 1] = k .. ":" .. seen[k]
    end
  end
  f:close()
  return list
end
M.trace_points = trace_points -- also torture/batchjob.lua's, queue.lua's, ledger.lua's and patterns.lua's

-- Runs one phase in a child; returns its status class and output.
local function phase(env, uri, dbname, s, kind, which)
  local c = proc.spawn({ "run", uri, dbname, s.name, kind, which }, env)
  local rc = proc.wait(c, 60)
  local out = proc.output(c)
  proc.cleanup(c)
  return rc and proc.classify(rc) or "hung", out
end

-- ctx: { uri, server (kind), full (bool), say(fmt, ...), scenarios (nil:
-- all, else a set of names) }
function M.run(ctx)
  local result = { cases = 0, violations = 0, crashes = 0, injected = 0, missed = 0,
                   failures = {} }
  local client = check.db(ctx.uri, "admin").client
  local cases, counter = {}, 0
  local function new_case(s, kind, fault)
    counter = counter + 1
    local c = { s = s, kind = kind, fault = fault,
                db = ("cp%d_%s_%s"):format(counter, s.name:gsub("%W", ""), kind) }
    check.load(check.db(ctx.uri, c.db), scenarios.fixture(kind, s.failing, s.balances))
    cases[#cases + 1] = c
    return c
  end
  -- prepare + run of one case; a wrong exit is a crash of the suite's
  -- own making or of the engine, counted and shown
  local function play(c, run_env)
    if c.s.prepare then
      local env = c.s.prepare_fault and { MONGOTX_FAULT = c.s.prepare_fault } or nil
      local how, out = phase(env, ctx.uri, c.db, c.s, c.kind, "prepare")
      if how ~= (c.s.prepare_fault and "injected" or "ok") then
        c.problem = "prepare " .. how .. ": " .. out
      end
    end
    local how, out = phase(run_env, ctx.uri, c.db, c.s, c.kind, "run")
    c.how = how
    if how ~= (c.fault and "injected" or "ok") and how ~= "ok" then
      c.problem = (c.problem and c.problem .. "; " or "") .. "run " .. how .. ": " .. out
    end
  end

  local list = {}
  for _, s in ipairs(scenarios.list) do
    if not ctx.scenarios or ctx.scenarios[s.name] then list[#list + 1] = s end
  end
  local function kinds_of(s)
    return (not ctx.full and s.ci_kinds) or s.kinds or scenarios.KINDS
  end
  for _, s in ipairs(list) do
    for _, kind in ipairs(kinds_of(s)) do
      local started = core.monotonic_ms()
      local trace = os.tmpname()
      local clean = new_case(s, kind, nil)
      play(clean, { MONGOTX_FAULT_TRACE = trace })
      local points = trace_points(trace)
      os.remove(trace)
      clean.points = points
      if not ctx.full then
        -- bounded run: every point's first time, before and after
        local first = {}
        for _, p in ipairs(points) do
          if p:match(":1$") then first[#first + 1] = p end
        end
        points = first
      end
      for _, p in ipairs(points) do
        local c = new_case(s, kind, p)
        play(c, { MONGOTX_FAULT = p })
        if c.how == "injected" then result.injected = result.injected + 1
        elseif c.how == "ok" then result.missed = result.missed + 1 end
      end
      ctx.say("  crashpoints %-23s %-7s %3d points %5.1f s", s.name, kind, #points,
        (core.monotonic_ms() - started) / 1000)
    end
  end

  -- recovery in one fresh process for all the databases of a direction
  local recovering = core.monotonic_ms()
  for _, direction in ipairs { "forward", "back" } do
    local names = {}
    for _, c in ipairs(cases) do
      if (c.s.recover or "forward") == direction then names[#names + 1] = c.db end
    end
    if #names > 0 then
      local rc, said = proc.recover(ctx.uri, names, direction, 60 + 5 * #names)
      if rc ~= 0 then
        result.crashes = result.crashes + 1
        result.failures[#result.failures + 1] = ("recovery process (%s) %s: %s"):format(
          direction, tostring(rc), said)
      end
    end
  end

  ctx.say("  crashpoints recovery of %d databases %.1f s", #cases,
    (core.monotonic_ms() - recovering) / 1000)

  local matrix = {}
  for _, c in ipairs(cases) do
    result.cases = result.cases + 1
    local allowed = { [scenarios.ID] = c.s.allowed, [scenarios.OTHER] = c.s.other }
    for k, v in pairs(c.s.also or {}) do allowed[k] = v end
    local rep = check.database(check.db(ctx.uri, c.db),
      scenarios.fixture(c.kind, c.s.failing, c.s.balances),
      { allowed = allowed })
    local cell = rep.states[scenarios.ID] or "absent"
    if c.fault and c.how == "ok" then cell = cell .. "(no crash)" end
    if c.problem then
      result.crashes = result.crashes + 1
      cell = "CRASH"
      result.failures[#result.failures + 1] = ("%s %s %s: %s"):format(c.s.name, c.kind,
        tostring(c.fault), c.problem)
    end
    if #rep.violations > 0 then
      result.violations = result.violations + #rep.violations
      cell = "VIOLATION"
      result.failures[#result.failures + 1] = ("%s %s %s (db %s): %s"):format(c.s.name, c.kind,
        tostring(c.fault), c.db, table.concat(rep.violations, "; "))
    elseif not c.problem then
      client:command(c.db, { dropDatabase = 1 })
    end
    local row = (matrix[c.s.name] or {})
    matrix[c.s.name] = row
    local key = c.fault or "clean"
    if not row[key] then
      row[key] = {}
      row[#row + 1] = key
    end
    row[key][c.kind] = cell
  end

  for _, s in ipairs(list) do
    local row = matrix[s.name]
    local kinds = kinds_of(s)
    ctx.say("")
    local head = ("  %-25s"):format(s.name)
    for _, k in ipairs(kinds) do head = head .. ("%-12s"):format(k) end
    ctx.say("%s", head)
    for _, key in ipairs(row or {}) do
      local line = ("  %-25s"):format(key)
      for _, k in ipairs(kinds) do line = line .. ("%-12s"):format(row[key][k] or "-") end
      ctx.say("%s", line)
    end
  end
  result.notes = ("%d injected crashes, %d points not reached"):format(result.injected,
    result.missed)
  return result
end

return M
