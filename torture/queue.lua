-- mongotx.queue under crashes, kill -9 and SIGSTOP (sections queue-crashpoints
-- and queue-kills of torture/run.lua; spec/61-queue_spec.lua uses the same
-- scenario and check).
--
-- Every job's handler applies the seed's idempotent effect: $addToSet of
-- the job's id onto the target document, with a counter raised in the same
-- write only when the id was not there (effect below).  The invariant
-- (check below): no job is in an unknown state, no running job lacks a
-- lease, the target's counter equals the number of ids it holds and every
-- id appears once; at the end, every job is done and its id is on the
-- target exactly once, and no id of a job that is not done is there.
--
--   queue-crashpoints  a clean run of the scenario lists the crash points
--       it passes (MONGOTX_FAULT_TRACE); for each (point, before|after,
--       first time) a child crashes there; then requeue_stale and a worker
--       loop in a fresh process finish the queue and the invariant holds.
--   queue-kills  workers run the queue while the driver kill -9s one at
--       random (and starts another) or SIGSTOPs one past its lease and
--       continues it; the invariant is checked while it runs and at the
--       end, and the stopped workers' done calls must have been fenced.

local proc = require "torture.proc"
local helpers = require "spec.helpers"
local core = require "mongotx.core"

local M = {}

M.TARGET = "T"   -- the target document's _id
M.LEASE = 1      -- seconds: short, so that the stopped workers lose their jobs

-- The queue and target collections of database `name`.
function M.open(uri, name, opts)
  local mongotx = require "mongotx"
  local db = assert(mongotx.connect(uri, { database = name }))
  local o = { lease = M.LEASE, max_attempts = 1000, backoff = function() return 0 end }
  for k, v in pairs(opts or {}) do o[k] = v end
  local q = assert(db:queue(o))
  return q, db:collection("targets"), db
end

function M.prepare(targets)
  assert(targets:insert_one({ _id = M.TARGET, jobs = core.array(), n = 0 }))
end

-- The idempotent handler: one conditional write adds the job's id and
-- counts it, only if the id is not there yet.
function M.effect(targets)
  return function(job)
    local res, err = targets:update_one({ _id = M.TARGET, jobs = { ["$ne"] = job._id } },
      { ["$addToSet"] = { jobs = job._id }, ["$inc"] = { n = 1 } })
    if not res then return nil, err end
    return { applied = res.modified == 1 }
  end
end

-- The crash-matrix scenario: two jobs pushed by id, one claimed, kept
-- alive, handled and done; the other claimed and failed (ready again);
-- then requeue_stale.  Each queue write it makes passes its crash points.
function M.scenario(q, targets)
  local handle = M.effect(targets)
  assert(q:push("effect", { n = 1 }, { id = "job-1" }))
  assert(q:push("effect", { n = 2 }, { id = "job-2", priority = -1 }))
  local job = assert(q:claim("w1", { "effect" }))
  assert(q:heartbeat(job))
  assert(handle(job))
  assert(q:done(job, { by = "w1" }))
  job = assert(q:claim("w1"))
  assert(q:fail(job, "first try fails"))
  assert(q:requeue_stale())
end

-- Finishes a queue after crashes: pushes the scenario's jobs again (a
-- caller retrying its push, idempotent by id), waits out the leases of
-- running jobs, then works until nothing is left.
function M.finish(q, targets)
  assert(q:push("effect", { n = 1 }, { id = "job-1" }))
  assert(q:push("effect", { n = 2 }, { id = "job-2", priority = -1 }))
  if q.jobs:find_one({ state = "running" }) then core.sleep(M.LEASE + 0.2) end
  local stats, err = q:work({ effect = M.effect(targets) }, { idle = 0 })
  assert(stats and not err, tostring(err))
  return stats
end

local STATES = { ready = true, running = true, done = true, dead = true }

-- The invariant over the jobs and the target; `final`: the queue must be
-- drained, every job done and its effect there once.  Returns a list of
-- violations (empty when it holds).
function M.check(jobs, targets, final)
  local bad = {}
  -- jobs first: a job seen done had its effect written before, so the
  -- target read after shows it (the other order races with workers)
  local list = assert(jobs:find_all({}))
  -- while workers run, a counter that disagrees with the ids is read
  -- again: one run in about ten saw it once, and never after.  That is
  -- mongo-java-server (1.47) reading a document halfway through an
  -- update: it applies an update to the stored document in place, key by
  -- key (AbstractMongoCollection.updateDocument removes the old keys and
  -- puts each new one; MemoryCollection.handleUpdate does nothing), and a
  -- find does not wait for it, so `jobs` can be read new and `n` old.
  -- It hides no double effect: nothing lowers n or removes an id, so an
  -- effect applied twice stays a mismatch, which the final check (one
  -- read, nothing running) and the later checks see
  local target
  for _ = 1, final and 1 or 5 do
    target = targets:find_one({ _id = M.TARGET })
    if not target then return { "the target document is missing" } end
    if target.n == #target.jobs then break end
    core.sleep(0.01)
  end
  local seen = {}
  for _, id in ipairs(target.jobs) do
    if seen[id] then bad[#bad + 1] = "effect of " .. tostring(id) .. " applied twice" end
    seen[id] = true
  end
  if target.n ~= #target.jobs then
    bad[#bad + 1] = ("counter %s but %d ids on the target"):format(tostring(target.n), #target.jobs)
  end
  local known = {}
  for _, j in ipairs(list) do
    known[j._id] = true
    if not STATES[j.state] then
      bad[#bad + 1] = ("job %s in state %s"):format(tostring(j._id), tostring(j.state))
    elseif j.state == "running" and core.type(j.lease_until) ~= "date" then
      bad[#bad + 1] = ("job %s running without a lease"):format(tostring(j._id))
    elseif j.state == "done" and not seen[j._id] then
      bad[#bad + 1] = ("job %s done without its effect"):format(tostring(j._id))
    end
    if final and j.state ~= "done" then
      bad[#bad + 1] = ("job %s left %s"):format(tostring(j._id), tostring(j.state))
    end
  end
  for id in pairs(seen) do
    if not known[id] then bad[#bad + 1] = "effect of an unknown job " .. tostring(id) end
  end
  return bad
end

-- "<point>:<when>:<n>" for each point a traced run passed
M.trace_points = require("torture.crashpoints").trace_points

local function child(args, env, seconds)
  local c = proc.spawn(args, env, "torture/queue_worker.lua")
  local rc = proc.wait(c, seconds or 60)
  local out = proc.output(c)
  proc.cleanup(c)
  return rc and proc.classify(rc) or "hung", out
end
M.child = child

-- Runs the scenario in a child crashing at `fault` (nil: none; `trace`: a
-- file to list the points in), finishes the queue in another and checks.
-- Returns how the child ended, the finisher's output and the violations.
function M.crash_case(uri, name, fault, trace)
  local env = {}
  if fault then env.MONGOTX_FAULT = fault end
  if trace then env.MONGOTX_FAULT_TRACE = trace end
  local how, out = child({ "scenario", uri, name }, env)
  local done, said = child({ "finish", uri, name }, nil)
  local q, targets, db = M.open(uri, name)
  local bad = M.check(q.jobs, targets, true)
  if done ~= "ok" then bad[#bad + 1] = "finish " .. done .. ": " .. said end
  if how ~= (fault and "injected" or "ok") then
    bad[#bad + 1] = "scenario " .. how .. ": " .. out
  end
  db.client:command(name, { dropDatabase = 1 })
  db:close()
  return how, bad
end

function M.crashpoints(ctx)
  local result = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local trace = os.tmpname()
  local function case(fault)
    result.cases = result.cases + 1
    local name = ("qcp%d"):format(result.cases)
    local how, bad = M.crash_case(ctx.uri, name, fault, fault == nil and trace or nil)
    if #bad > 0 then
      result.violations = result.violations + #bad
      result.failures[#result.failures + 1] = ("%s: %s"):format(fault or "clean",
        table.concat(bad, "; "))
    end
    ctx.say("  queue %-28s %s", fault or "clean", #bad == 0 and how or "VIOLATION")
  end
  case(nil)
  local points = M.trace_points(trace)
  os.remove(trace)
  for _, p in ipairs(points) do
    if ctx.full or p:match(":1$") then case(p) end
  end
  result.notes = ("%d crash points of the queue scenario"):format(result.cases - 1)
  return result
end

M.WORKERS = 4
M.JOBS_PER_ROUND = 30

function M.kills(ctx)
  local seconds = ctx.seconds or (ctx.full and 120 or 20)
  local name = "queue_kills"
  local q, targets, db = M.open(ctx.uri, name)
  M.prepare(targets)
  local stop_file = os.tmpname()
  os.remove(stop_file)
  local workers, n, jobs = {}, 0, 0
  local function spawn()
    n = n + 1
    local c = proc.spawn({ "work", ctx.uri, name, "w" .. n, stop_file }, nil,
      "torture/queue_worker.lua")
    c.name = "w" .. n
    workers[#workers + 1] = c
  end
  local function push(count)
    for _ = 1, count do
      jobs = jobs + 1
      assert(q:push("effect", { i = jobs }, { id = ("job-%06d"):format(jobs) }))
    end
  end
  local result = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local function look(final)
    result.cases = result.cases + 1
    for _, v in ipairs(M.check(q.jobs, targets, final)) do
      result.violations = result.violations + 1
      result.failures[#result.failures + 1] = (final and "at the end: " or "while running: ") .. v
    end
  end
  push(M.JOBS_PER_ROUND * 4)
  for _ = 1, ctx.workers or M.WORKERS do spawn() end
  local stop = core.monotonic_ms() + seconds * 1000
  local kills, stops = 0, 0
  while core.monotonic_ms() < stop do
    push(M.JOBS_PER_ROUND)
    core.sleep(0.2 + math.random() * 0.4)
    -- a worker once stopped is not killed: its output says how many of
    -- its calls were fenced
    local live = {}
    for _, c in ipairs(workers) do
      if not proc.status(c) and not c.stopped then live[#live + 1] = c end
    end
    local w = live[math.random(#live)]
    if math.random(3) == 1 and #live > 2 and q.jobs:find_one({ state = "running",
        worker = w.name }) then
      -- holding a job, past its lease: the job is requeued and taken by
      -- another worker, and this one's done or fail must be fenced
      helpers.signal(w.pid, "STOP")
      core.sleep(2 * M.LEASE + math.random())
      helpers.signal(w.pid, "CONT")
      w.stopped = true
      stops = stops + 1
      spawn()
    else
      helpers.signal(w.pid, "KILL")
      kills = kills + 1
      spawn()
    end
    look(false)
  end
  -- the workers drain the queue and exit
  local f = assert(io.open(stop_file, "w"))
  f:close()
  local fenced = 0
  for _, c in ipairs(workers) do
    local rc = proc.wait(c, 120)
    local how, out = rc and proc.classify(rc) or "hung", proc.output(c)
    fenced = fenced + tonumber(out:match("fenced (%d+)") or 0)
    if how ~= "ok" and how ~= "killed" then
      result.crashes = result.crashes + 1
      result.failures[#result.failures + 1] = "worker " .. how .. ": " .. out
    end
    proc.cleanup(c)
  end
  os.remove(stop_file)
  look(true)
  local counts = assert(q:counts())
  if counts.done ~= jobs then
    result.violations = result.violations + 1
    result.failures[#result.failures + 1] = ("%d of %d jobs done"):format(counts.done, jobs)
  end
  if stops > 0 and fenced == 0 then
    result.failures[#result.failures + 1] = "no stopped worker was fenced: the run proved " ..
      "nothing about fencing"
    result.violations = result.violations + 1
  end
  result.notes = ("%d jobs, %d s, %d kills, %d stops, %d done/fail calls fenced"):format(jobs,
    seconds, kills, stops, fenced)
  ctx.say("  queue-kills: %s", result.notes)
  if result.violations == 0 and result.crashes == 0 then
    db.client:command(name, { dropDatabase = 1 })
  end
  db:close()
  return result
end

return M
