-- Section batchjob: examples/06-batch-job.lua (tm:each, monthly interest)
-- killed over and over and run again.  Each round starts the job once
-- more on the same database with the same job id and stops it either at
-- a crash point (MONGOTX_FAULT: a point of the job's own trace, taken
-- from a clean run on a scratch database, at a random nth pass) or by
-- kill -9 after a random delay.  While a run goes, an observer reads every
-- account again and again; between runs and at the end
-- (spec/support/interest_job.lua's check) every account holds its opening
-- balance or that plus its interest, never more, and is marked paid
-- exactly when it has it.  Then runs without faults until one completes:
-- every account due interest paid exactly once, every transaction done,
-- and one more run writes nothing (the database byte-identical) and
-- reports everything skipped.
-- mongo-java-server only (see torture/run.lua).

local proc = require "torture.proc"
local crashpoints = require "torture.crashpoints"
local job = require "spec.support.interest_job"
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local M = {}

local JOB = "interest-torture"

local function args(name, accounts, batch)
  return { "--database", name, "--accounts", tostring(accounts), "--batch", tostring(batch),
           "--lease", "1", "--quiet", "--job", JOB }
end

-- The crash points a clean run of the job passes (point:when:n).
local function points(uri, accounts, batch)
  local name = helpers.db_name()
  local db = assert(mongotx.connect(uri, { database = name }))
  job.create(db:collection("accounts"), accounts)
  local trace = os.tmpname()
  local c = proc.spawn(args(name, accounts, batch), { MONGOTX_TEST_URI = uri, MONGOTX_FAULT_TRACE = trace },
    "examples/06-batch-job.lua")
  local rc = proc.wait(c, 120)
  proc.cleanup(c)
  local list = crashpoints.trace_points(trace)
  os.remove(trace)
  db.client:command(name, { dropDatabase = 1 })
  db:close()
  assert(rc == 0 and #list > 0, "the clean run of the job failed")
  return list
end

-- One run of the job on database `name`, stopped by `fault` or, without
-- one, by kill -9 after `delay` seconds; the accounts are checked while it
-- runs.  Returns its status class and the violations seen.
local function round(uri, name, accounts, batch, fault, delay)
  local db = assert(mongotx.connect(uri, { database = name }))
  local coll = db:collection("accounts")
  local env = { MONGOTX_TEST_URI = uri, MONGOTX_FAULT = fault }
  local c = proc.spawn(args(name, accounts, batch), env, "examples/06-batch-job.lua")
  local seen = {}
  local stop = mongotx.core.monotonic_ms() + (delay or 120) * 1000
  local rc
  repeat
    for _, v in ipairs((job.check(coll, accounts, JOB, false))) do seen[#seen + 1] = "while: " .. v end
    mongotx.core.sleep(0.05)
    rc = proc.status(c)
  until rc or mongotx.core.monotonic_ms() > stop
  if not rc then
    helpers.signal(c.pid, "KILL")
    rc = proc.wait(c, 30)
  end
  local out = proc.output(c)
  proc.cleanup(c)
  for _, v in ipairs((job.check(coll, accounts, JOB, false))) do seen[#seen + 1] = "after: " .. v end
  db:close()
  local class = rc and proc.classify(rc) or "hung"
  if class == "crash" or class == "hung" then seen[#seen + 1] = class .. ": " .. out end
  return class, seen, out
end

-- One database: the job stopped again and again (`rounds` at most) until
-- a run completes it, then the final checks.  Adds to r; returns the
-- number of runs stopped, at crash points and by kill -9.
local function campaign(ctx, r, list, accounts, batch, rounds)
  local name = helpers.db_name()
  local db = assert(mongotx.connect(ctx.uri, { database = name }))
  local coll = db:collection("accounts")
  job.create(coll, accounts)
  local function note(seen)
    for _, v in ipairs(seen) do
      r.violations = r.violations + 1
      if #r.failures < 20 then r.failures[#r.failures + 1] = v end
    end
  end
  local faults, kills, finished = 0, 0, nil
  -- stopped runs, then (after `rounds` of them) runs without faults
  for n = 1, rounds + 5 do
    local fault, delay
    if n <= rounds and math.random(2) == 1 then
      fault = list[math.random(#list)]
    elseif n <= rounds then
      delay = 0.1 + math.random() * 0.8
    end
    local class, seen, out = round(ctx.uri, name, accounts, batch, fault, delay)
    if class == "crash" or class == "hung" then r.crashes = r.crashes + 1 end
    if class == "injected" then faults = faults + 1 elseif class == "killed" then kills = kills + 1 end
    r.cases = r.cases + 1
    note(seen)
    local report = job.parse(out)
    if class == "ok" and report and report.failed == 0 then finished = report break end
  end
  local due = job.due(accounts)
  if not finished then
    note { name .. ": the job never completed" }
  else
    note((job.check(coll, accounts, JOB, true)))
    local s = assert(assert(db:manager {}):stats())
    local others = s.cancelled + s.pending + s.applied + s.initial + s.canceling
    if s.done ~= due or others ~= 0 then
      note { ("%s: %d transactions done of %d due, %d others"):format(name, s.done, due, others) }
    end
    local before = helpers.db_dump(db.client, name)
    local class, seen, out = round(ctx.uri, name, accounts, batch, nil, nil)
    note(seen)
    local report = job.parse(out)
    if class ~= "ok" or not report or report.skipped ~= due or report.committed ~= 0 then
      note { "the run after the end did not skip everything: " .. out }
    end
    if helpers.db_dump(db.client, name) ~= before then
      note { "the run after the end changed the database" }
    end
  end
  db.client:command(name, { dropDatabase = 1 })
  db:close()
  return faults, kills
end

function M.run(ctx)
  local accounts = ctx.full and 3000 or 1000
  local batch = 20
  local stops = ctx.full and 60 or 16
  local list = points(ctx.uri, accounts, batch)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local faults, kills, campaigns = 0, 0, 0
  while faults + kills < stops do
    local f, k = campaign(ctx, r, list, accounts, batch, stops - faults - kills)
    faults, kills, campaigns = faults + f, kills + k, campaigns + 1
    if f + k == 0 and r.violations > 0 then break end
  end
  r.notes = ("%d accounts, %d jobs, %d runs stopped (%d at crash points, %d by kill -9)")
    :format(accounts, campaigns, faults + kills, faults, kills)
  ctx.say("  batchjob: %s", r.notes)
  return r
end

return M
