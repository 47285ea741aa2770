-- Section 3, stalls: a worker is stopped (SIGSTOP) past its 1 s lease
-- while it holds a transaction, others take the transaction over, then it
-- is continued (SIGCONT) with whatever write it had prepared.  Nothing may
-- be applied twice (version fencing, README "How fencing works").
--   points: one transaction (A->B plus a ledger insert) stopped after each
--           of its step events in turn, taken over rolling forward and
--           rolling back by a recovery process, then continued;
--   random: 4 workers of the random workload (20 floored accounts, all
--           debits guarded), one stopped at a random moment for 1.2-2.5 s
--           again and again while the others keep working and recovering
--           (taking over what it holds).
-- The floor observer (torture/observer.lua) watches every case's database
-- from before its worker starts until after its recovery.
-- mongo-java-server only (see torture/run.lua).

local proc = require "torture.proc"
local check = require "torture.check"
local fleet = require "torture.fleet"
local scenarios = require "torture.scenarios"
local observer = require "torture.observer"
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local core = mongotx.core

local M = {}

local function state(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s:match("%) (%a)")
end

local function result_of(out)
  local word, code = out:match("result (%a+) ?(%S*)")
  if word == "done" then return "done" end
  return code ~= "" and code or nil
end

-- One stop after event `at`; returns the case's failures and what happened.
local function one(ctx, at, direction, r)
  local dbname = ("st_%s_%d"):format(direction, at)
  local db = check.db(ctx.uri, dbname)
  local fixture = scenarios.fixture("insert")
  check.load(db, fixture)
  local obs = observer.start(ctx.uri, dbname)
  local w = proc.spawn({ "stall", ctx.uri, dbname, at, direction })
  local stopped = false
  for _ = 1, 1000 do
    local st = state(w.pid)
    if st == "T" then stopped = true break end
    if not st or st == "Z" or proc.status(w) then break end
    core.sleep(0.01)
  end
  local taken
  if stopped then
    core.sleep(1.2) -- past the stalled owner's lease
    local rc, said = proc.recover(ctx.uri, { dbname }, direction, 60)
    if rc ~= 0 then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = dbname .. " recovery: " .. said
    end
    taken = assert(db:manager { application = "checker" }):get(scenarios.ID)
    helpers.signal(w.pid, "CONT")
  end
  local rc = proc.wait(w, 60)
  local out = proc.output(w)
  proc.cleanup(w)
  if rc ~= 0 then
    r.crashes = r.crashes + 1
    r.failures[#r.failures + 1] = ("%s worker status %s: %s"):format(dbname, tostring(rc), out)
  end
  local o = obs:stop()
  observer.add(r, o, dbname .. " observer")
  r.polls = (r.polls or 0) + o.polls
  local rep = check.database(db, fixture, { reported = { [scenarios.ID] = result_of(out) },
    allowed = { [scenarios.ID] = { done = true, cancelled = true } } })
  r.cases = r.cases + 1
  r.violations = r.violations + #rep.violations
  for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = dbname .. ": " .. v end
  return stopped, out:match("events (%d+)"), taken and taken.state, rep.states[scenarios.ID]
end

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  -- how many step events a transaction passes, from a run never stopped
  local _, events = one(ctx, 0, "forward", r)
  events = tonumber(events) or 0
  local stops = 0
  for _, direction in ipairs { "forward", "back" } do
    for at = 1, events do
      local stopped, _, taken, final = one(ctx, at, direction, r)
      if stopped then stops = stops + 1 end
      ctx.say("  stall after event %2d, taken over %-7s: recovery left it %-9s final %s",
        at, direction, tostring(taken), tostring(final))
    end
  end

  local f = fleet.new(ctx.uri, "stalls", { accounts = 20, tokens = 300 })
  for _ = 1, ctx.workers or 4 do f:spawn() end
  local stop = core.monotonic_ms() + (ctx.seconds or (ctx.full and 180 or 40)) * 1000
  local random_stops = 0
  while core.monotonic_ms() < stop do
    local w = f:pick()
    helpers.signal(w.pid, "STOP")
    core.sleep(1.2 + math.random() * 1.3)
    helpers.signal(w.pid, "CONT")
    random_stops = random_stops + 1
    core.sleep(math.random() * 0.5)
  end
  local fr = f:finish()
  r.cases = r.cases + fr.cases
  r.violations = r.violations + fr.violations
  r.crashes = r.crashes + fr.crashes
  for _, v in ipairs(fr.failures) do r.failures[#r.failures + 1] = "random: " .. v end
  r.notes = ("%d events x 2 directions, %d stopped, observer %d polls; random: %d stops, %s")
    :format(events, stops, r.polls or 0, random_stops, fr.notes)
  ctx.say("  %s", r.notes)
  return r
end

return M
