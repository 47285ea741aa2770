-- mongotx.queue (lua/mongotx/queue.lua): a job queue with claims by
-- findAndModify, leases by the server's clock, fencing by the job's
-- epoch, retries with backoff and dead letters.  Each case asserts what
-- the jobs collection holds afterwards; bad input gets `invalid` (or a
-- raise for a wrong type) and writes nothing; several worker processes
-- and crashes at each of the module's crash points keep every job's
-- effect exactly once (torture/queue.lua has the scenario and the check).

local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local tq = require "torture.queue"

local core = mongotx.core
local nan = 0 / 0

-- A queue on a fresh database: no backoff, so failed jobs are ready again
-- at once, unless opts say otherwise.
local function fresh(opts)
  local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  local o = { backoff = function() return 0 end }
  for k, v in pairs(opts or {}) do o[k] = v end
  local q = assert(db:queue(o))
  return q, db
end

local function job_doc(q, id)
  return assert(q.jobs:find_one({ _id = id }))
end

describe("#server queue", function()
  local q, db

  -- replaces this case's queue with one of these options
  local function reopen(opts)
    db:close()
    q, db = fresh(opts)
  end

  before_each(function() q, db = fresh() end)
  after_each(function() db:close() end)

  describe("normal use", function()
    it("push, claim, heartbeat and done move a job ready -> running -> done", function()
      local pushed = assert(q:push("mail", { to = "a@example.org" }, { id = "m1" }))
      assert.are.equal("ready", pushed.state)
      local stored = job_doc(q, "m1")
      assert.are.same({ "ready", "mail", "a@example.org", 0, 0, 0 }, { stored.state,
        stored.type, stored.details.to, stored.attempts, stored.epoch, stored.priority })
      assert.are.equal("date", core.type(stored.ts))

      local job = assert(q:claim("w1"))
      assert.are.equal("m1", job._id)
      stored = job_doc(q, "m1")
      assert.are.same({ "running", "w1", 1, 1 }, { stored.state, stored.worker,
        stored.epoch, stored.attempts })
      -- the lease is the policy's 30 s by the server's clock
      local now = assert(q.clock:read())
      local left = stored.lease_until:value() - now
      assert.is_true(left > 25000 and left <= 31000, "lease left " .. left)
      assert.is_false(q:claim("w2"), "a running job is not claimed again")

      local until_ = assert(q:heartbeat(job))
      assert.are.equal(until_:value(), job_doc(q, "m1").lease_until:value())
      assert.is_true(q:done(job, { sent = true }))
      stored = job_doc(q, "m1")
      assert.are.same({ "done", true }, { stored.state, stored.result.sent })
      assert.is_nil(stored.lease_until)
      assert.are.equal("date", core.type(stored.finished))
      assert.is_true(q:done(job, { sent = true }), "a repeated done of the same claim")
      assert.are.same({ ready = 0, running = 0, done = 1, dead = 0 }, assert(q:counts()))
    end)

    it("claims by priority, then oldest first, skips jobs not due and filters by type", function()
      assert(q:push("a", 1, { id = 1 }))
      assert(q:push("a", 2, { id = 2, priority = 5 }))
      assert(q:push("b", 3, { id = 3 }))
      assert(q:push("a", 4, { id = 4, at = 3600 })) -- due in an hour
      assert(q:push("a", 5, { id = 5 }))
      local order = {}
      for _ = 1, 3 do order[#order + 1] = assert(q:claim("w", { "a" }))._id end
      assert.are.same({ 2, 1, 5 }, order)
      assert.is_false(q:claim("w", { "a" }), "job 4 is not due, job 3 has another type")
      assert.are.equal(3, assert(q:claim("w"))._id)
      assert.are.equal("ready", job_doc(q, 4).state)
    end)

    it("push with an id is idempotent; other content under that id is refused", function()
      local first = assert(q:push("mail", { to = "x" }, { id = "same" }))
      local again = assert(q:push("mail", { to = "x" }, { id = "same" }))
      assert.are.equal(first._id, again._id)
      assert.are.equal(1, q.jobs:count({}))
      local before = helpers.db_dump(db.client, db.name)
      local res, err = q:push("mail", { to = "y" }, { id = "same" })
      assert.is_nil(res)
      assert.are.equal("idempotency", err.code)
      res, err = q:push("sms", { to = "x" }, { id = "same" })
      assert.is_nil(res)
      assert.are.equal("idempotency", err.code)
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end)

    it("fail retries with the policy's backoff, then dead-letters after max_attempts", function()
      local waits = {}
      reopen { max_attempts = 3, backoff = function(attempts, err)
        waits[#waits + 1] = { attempts, err }
        return 0
      end }
      assert(q:push("flaky", {}, { id = "f" }))
      for attempt = 1, 2 do
        local job = assert(q:claim("w"))
        assert.are.equal(attempt, job.attempts)
        assert.are.equal("ready", assert(q:fail(job, "boom " .. attempt)))
        local stored = job_doc(q, "f")
        assert.are.same({ "ready", "boom " .. attempt }, { stored.state, stored.error })
      end
      assert.are.same({ { 1, "boom 1" }, { 2, "boom 2" } }, waits)
      local job = assert(q:claim("w"))
      assert.are.equal("dead", assert(q:fail(job, { message = "still broken" })))
      local stored = job_doc(q, "f")
      assert.are.same({ "dead", "still broken", 3 }, { stored.state, stored.error, stored.attempts })
      assert.is_false(q:claim("w"), "a dead job is never claimed")
    end)

    it("a failed job waits its backoff by the server's clock", function()
      reopen { backoff = function() return 3600 end }
      assert(q:push("slow", {}, { id = "s" }))
      local job = assert(q:claim("w"))
      local before = assert(q.clock:read())
      assert.are.equal("ready", assert(q:fail(job, "later")))
      local due = job_doc(q, "s").ts:value() - before
      assert.is_true(due > 3590000 and due < 3610000, "due in " .. due .. " ms")
      assert.is_false(q:claim("w"))
    end)

    it("a backoff policy that raises or returns no duration writes nothing", function()
      for _, bad in ipairs { function() error("policy bug") end, function() return nan end,
                             function() return "soon" end, function() return -1 end } do
        reopen { backoff = bad }
        assert(q:push("x", {}, { id = "p" }))
        local job = assert(q:claim("w"))
        local before = helpers.db_dump(db.client, db.name)
        local res, err = q:fail(job, "e")
        assert.is_nil(res)
        assert.are.equal("policy", err.code)
        helpers.assert_dump_unchanged(before, db.client, db.name)
      end
    end)
  end)

  describe("fencing", function()
    -- A claim whose lease expired, requeued by requeue_stale and taken by
    -- another worker: the first worker's calls are refused and change
    -- nothing; the second's go through.
    it("a worker whose job was requeued and retaken gets fenced", function()
      reopen { lease = 0.3 }
      assert(q:push("t", {}, { id = "j" }))
      local stale = assert(q:claim("slow"))
      core.sleep(0.5)
      assert.are.same({ requeued = 1, dead = 0 }, assert(q:requeue_stale()))
      local stored = job_doc(q, "j")
      assert.are.same({ "ready", "lease expired" }, { stored.state, stored.error })
      -- requeued but not yet retaken: already fenced by the state
      local res, err = q:done(stale)
      assert.is_nil(res)
      assert.are.equal("fenced", err.code)
      local fresh_claim = assert(q:claim("fast"))
      assert.are.equal(2, fresh_claim.epoch)
      local before = helpers.db_dump(db.client, db.name)
      for _, call in ipairs { function() return q:done(stale, "late") end,
                              function() return q:heartbeat(stale) end,
                              function() return q:fail(stale, "late") end } do
        res, err = call()
        assert.is_nil(res)
        assert.are.equal("fenced", err.code, tostring(err))
        assert.matches("epoch 1", err.message)
      end
      helpers.assert_dump_unchanged(before, db.client, db.name)
      assert.is_true(q:done(fresh_claim, "on time"))
      assert.are.same({ "done", "on time", "fast" }, { job_doc(q, "j").state,
        job_doc(q, "j").result, job_doc(q, "j").worker })
    end)

    it("requeue_stale leaves live leases alone and dead-letters exhausted jobs", function()
      reopen { lease = 0.3, max_attempts = 1 }
      assert(q:push("t", {}, { id = "old" }))
      assert(q:push("t", {}, { id = "live" }))
      local old = assert(q:claim("w"))
      core.sleep(0.5)
      local live = assert(q:claim("w"))
      assert.are.equal("live", live._id)
      assert.are.same({ requeued = 0, dead = 1 }, assert(q:requeue_stale()))
      assert.are.same({ "dead", "running" }, { job_doc(q, old._id).state, job_doc(q, "live").state })
      assert.are.equal("fenced", select(2, q:done(old)).code)
      assert.is_true(q:done(live))
    end)

    it("a heartbeat keeps a slow worker's job from being requeued", function()
      reopen { lease = 0.4 }
      assert(q:push("t", {}, { id = "j" }))
      local job = assert(q:claim("w"))
      for _ = 1, 4 do
        core.sleep(0.2)
        assert(q:heartbeat(job))
        assert.are.same({ requeued = 0, dead = 0 }, assert(q:requeue_stale()))
      end
      assert.is_true(q:done(job))
    end)
  end)

  describe("work", function()
    it("runs handlers until idle, with the seed's $addToSet effect exactly once", function()
      reopen { max_attempts = 2 }
      local targets = db:collection("targets")
      tq.prepare(targets)
      for i = 1, 6 do assert(q:push("effect", { i = i }, { id = "e" .. i })) end
      assert(q:push("broken", {}, { id = "returns-error" }))
      assert(q:push("raises", {}, { id = "raises" }))
      assert(q:push("unstorable", {}, { id = "unstorable" }))
      local effect = tq.effect(targets)
      local stats = assert(q:work({
        effect = effect,
        broken = function() return nil, "no such mailbox" end,
        raises = function() error("handler bug") end,
        unstorable = function() return { ["$set"] = 1 } end,
      }, { worker = "w", idle = 0 }))
      assert.are.same({ done = 6, failed = 3, dead = 3, fenced = 0 }, stats)
      local t = assert(targets:find_one({ _id = tq.TARGET }))
      assert.are.equal(6, t.n)
      assert.are.same({}, tq.check(q.jobs, targets, false))
      assert.are.equal("no such mailbox", job_doc(q, "returns-error").error)
      assert.matches("handler bug", job_doc(q, "raises").error)
      assert.matches("operator", job_doc(q, "unstorable").error)
      assert.are.same({ ready = 0, running = 0, done = 6, dead = 3 }, assert(q:counts()))
      -- the handler is idempotent: running a done job's handler again
      -- (a retaken job's second run) changes nothing
      assert(effect(job_doc(q, "e1")))
      assert.are.equal(6, assert(targets:find_one({ _id = tq.TARGET })).n)
    end)

    it("stops after max_jobs, when stop() says so, and waits `idle` seconds", function()
      for i = 1, 5 do assert(q:push("t", i, { id = i })) end
      local seen = {}
      local handlers = { t = function(job) seen[#seen + 1] = job._id end }
      assert.are.same({ done = 2, failed = 0, dead = 0, fenced = 0 },
        assert(q:work(handlers, { max_jobs = 2 })))
      local calls = 0
      assert.are.same({ done = 1, failed = 0, dead = 0, fenced = 0 }, assert(q:work(handlers,
        { stop = function() calls = calls + 1 return calls > 1 end })))
      assert.are.same({ 1, 2, 3 }, seen)
      local started = core.monotonic_ms()
      assert.are.equal(2, assert(q:work(handlers, { idle = 0.3, poll = 0.05 })).done)
      assert.is_true(core.monotonic_ms() - started >= 300, "waited idle")
      assert.are.same({ ready = 0, running = 0, done = 5, dead = 0 }, assert(q:counts()))
    end)

    it("requeues a dead worker's expired jobs while busy and runs them", function()
      reopen { lease = 0.2 }
      assert(q:push("t", "orphan", { id = "orphan" }))
      assert(q:claim("died"))
      for i = 1, 3 do assert(q:push("t", i, { id = i })) end
      core.sleep(0.3)
      local ran = {}
      local stats = assert(q:work({ t = function(job) ran[#ran + 1] = job._id end }, { idle = 0 }))
      assert.are.equal(4, stats.done)
      assert.are.equal("orphan", ran[1], "requeued before the first claim, and oldest")
      assert.are.equal(2, job_doc(q, "orphan").epoch)
    end)
  end)

  describe("bad input", function()
    -- fn() must return nil and an `invalid` error whose message finds msg,
    -- and write nothing.
    local function invalid(step, fn, msg) helpers.assert_invalid(db, step, fn, msg) end
    local function raises(fn, msg)
      local before = helpers.db_dump(db.client, db.name)
      local ok, raised = pcall(fn)
      assert.is_false(ok)
      assert.truthy(tostring(raised):find(msg, 1, true), tostring(raised))
      assert.matches("61%-queue_spec.lua:%d+:", tostring(raised), 1, "names the caller's line")
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end

    it("push refuses details and ids that could become operators, and bad options", function()
      assert(q:push("t", {}, { id = "existing" }))
      invalid("push", function() return q:push("t", { ["$where"] = "1" }) end, '"$where"')
      invalid("push", function() return q:push("t", { a = { ["$gt"] = 1 } }) end, '"$gt"')
      invalid("push", function() return q:push("t", { ["a.b"] = 1 }) end, "dots")
      invalid("push", function() return q:push("t", { x = nan }) end, "nan")
      invalid("push", function() return q:push("t", print) end, "cannot be stored")
      local loop = {}
      loop.self = loop
      invalid("push", function() return q:push("t", loop) end, "cannot be stored")
      invalid("push", function() return q:push("", {}) end, "type")
      invalid("push", function() return q:push("t", {}, { id = { ["$gt"] = "" } }) end, "$gt")
      invalid("push", function() return q:push("t", {}, { id = mongotx.Regex(".*", "") }) end, "id")
      invalid("push", function() return q:push("t", {}, { id = nan }) end, "id")
      invalid("push", function() return q:push("t", {}, { at = -1 }) end, "option at")
      invalid("push", function() return q:push("t", {}, { at = nan }) end, "option at")
      invalid("push", function() return q:push("t", {}, { priority = 1.5 }) end, "option priority")
      raises(function() q:push(nil, {}) end, "type must be a string")
      raises(function() q:push("t", {}, { ttl = 1 }) end, "unknown option ttl")
      raises(function() q:push("t", {}, { priority = "high" }) end, "option priority")
      raises(function() q:push("t", {}, 5) end, "options of push")
      -- a metatable cannot show the checks one table and the encoder another
      local sneaky = setmetatable({}, { __index = function() return "x" end,
        __pairs = function() return next, {} end })
      rawset(sneaky, "$set", 1)
      invalid("push", function() return q:push("t", sneaky) end, '"$set"')
    end)

    it("claim, heartbeat, done and fail refuse bad arguments", function()
      assert(q:push("t", {}, { id = "j" }))
      invalid("claim", function() return q:claim("") end, "worker")
      invalid("claim", function() return q:claim("w", {}) end, "empty list")
      invalid("claim", function() return q:claim("w", { "t", 5 }) end, "types[2]")
      invalid("claim", function() return q:claim("w", { "t", x = "u" }) end, "list")
      invalid("claim", function() return q:claim("w", { { ["$ne"] = "x" } }) end, "types[1]")
      raises(function() q:claim(nil) end, "worker must be a string")
      raises(function() q:claim("w", "t") end, "types must be a list")
      local job = assert(q:claim("w"))
      invalid("done", function() return q:done(job, { ["$inc"] = 1 }) end, "result")
      raises(function() q:done({ _id = "j" }) end, "expects a job")
      raises(function() q:heartbeat("j") end, "expects a job")
      raises(function() q:fail({ _id = "j", epoch = 1 }, "e") end, "expects a job")
      invalid("done", function() return q:done({ _id = { ["$gt"] = "" }, epoch = 1 }) end, "$gt")
      invalid("heartbeat", function() return q:heartbeat({ _id = { ["$gt"] = "" }, epoch = 1 }) end, "$gt")
      invalid("get", function() return q:get({ ["$gt"] = "" }) end, "$gt")
      invalid("work", function() return q:work({ t = print }, { types = { "u" } }) end, "no handler")
      invalid("work", function() return q:work({ t = print }, { idle = -1 }) end, "option idle")
      invalid("work", function() return q:work({ t = print }, { max_jobs = 0 }) end, "option max_jobs")
      raises(function() q:work({ t = 1 }) end, "handlers")
      raises(function() q:work(nil) end, "handlers must be a table")
      raises(function() q:work({ t = print }, { stop = true }) end, "option stop")
      assert.are.equal("running", job_doc(q, "j").state)
    end)

    it("db:queue checks its options", function()
      local name = helpers.db_name()
      local other = assert(mongotx.connect(helpers.uri(), { database = name }))
      local res, err = other:queue { lease = -1 }
      assert.is_nil(res)
      assert.are.equal("invalid", err.code)
      res, err = other:queue { collection = "system.jobs" }
      assert.is_nil(res)
      assert.are.equal("invalid", err.code)
      assert.has_error(function() other:queue { leese = 1 } end, "unknown option leese for queue")
      assert.has_error(function() other:queue { backoff = 1 } end)
      assert.are.equal("", helpers.db_dump(other.client, name))
      other:close()
    end)
  end)

  describe("indexes", function()
    it("db:queue creates the claim and lease indexes", function()
      local reply = assert(db.client:command(db.name, { listIndexes = "jobs" }))
      local keys = {}
      for _, ix in ipairs(reply.cursor.firstBatch) do
        local names = {}
        for _, k in ipairs(getmetatable(ix.key) or { (next(ix.key)) }) do names[#names + 1] = k end
        keys[#keys + 1] = table.concat(names, ",")
      end
      table.sort(keys)
      assert.are.same({ "_id", "state,lease_until", "state,priority,ts" }, keys)
    end)
  end)
end)

-- Several worker processes on one queue, one of them SIGSTOPped past its
-- lease: every job done once, its effect there once, the stopped worker's
-- done refused.
describe("#server #concurrency queue workers", function()
  local reason = helpers.no_concurrency()
  if reason then
    it("run on servers that isolate concurrent writers", function()
      print("\n  pending on this server: " .. reason)
      pending(reason)
    end)
    return
  end

  it("run every job exactly once in effect, and fence a stalled worker", function()
    local name = helpers.db_name()
    local q, targets, db = tq.open(helpers.uri(), name)
    tq.prepare(targets)
    for i = 1, 60 do assert(q:push("effect", { i = i }, { id = ("job-%03d"):format(i) })) end
    local stop_file = os.tmpname()
    os.remove(stop_file)
    local proc = require "torture.proc"
    local workers = {}
    for w = 1, 3 do
      workers[w] = proc.spawn({ "work", helpers.uri(), name, "w" .. w, stop_file }, nil,
        "torture/queue_worker.lua")
    end
    -- stop worker w1 while it holds a job (seen after the stop, so that the
    -- job is not one it finished meanwhile), and keep it stopped until
    -- another worker has retaken the job
    local held
    for _ = 1, 100 do
      helpers.signal(workers[1].pid, "STOP")
      core.sleep(0.05) -- a write already sent lands
      held = q.jobs:find_one({ state = "running", worker = "w1" })
      if held then break end
      helpers.signal(workers[1].pid, "CONT")
      core.sleep(0.02)
    end
    assert.is_table(held, "worker w1 never held a job")
    for _ = 1, 200 do
      assert.are.same({}, tq.check(q.jobs, targets, false))
      local now = q.jobs:find_one({ _id = held._id })
      if now.epoch > held.epoch then break end
      core.sleep(0.1)
    end
    helpers.signal(workers[1].pid, "CONT")
    local f = assert(io.open(stop_file, "w"))
    f:close()
    local fenced = 0
    for _, c in ipairs(workers) do
      assert.are.equal(0, proc.wait(c, 60), proc.output(c))
      fenced = fenced + tonumber(proc.output(c):match("fenced (%d+)"))
      proc.cleanup(c)
    end
    os.remove(stop_file)
    assert.are.same({}, tq.check(q.jobs, targets, true))
    assert.are.equal(60, assert(targets:find_one({ _id = tq.TARGET })).n)
    assert.is_true(job_doc(q, held._id).epoch > held.epoch, "the stalled job was retaken")
    assert.is_true(fenced >= 1, "the stalled worker's done was refused")
    db:close()
  end)
end)

-- Crash points: the scenario of torture/queue.lua crashes at each point of
-- the module (the first time it passes it, before and after the write);
-- requeue_stale and a worker loop in a fresh process then finish the
-- queue, and every job is done with its effect there once.
describe("#server queue crash points", function()
  local trace = os.tmpname()
  local how, bad = tq.crash_case(helpers.uri(), helpers.db_name(), nil, trace)
  local points = tq.trace_points(trace)
  os.remove(trace)

  it("the clean scenario passes every point of the module", function()
    assert.are.equal("ok", how)
    assert.are.same({}, bad)
    local names = {}
    for _, p in ipairs(points) do names[p:match("^queue%.(%a+)")] = true end
    assert.are.same({ push = true, claim = true, heartbeat = true, done = true, fail = true,
                      requeue = true }, names)
  end)

  for _, p in ipairs(points) do
    if p:match(":1$") then
      it("a crash at " .. p .. " is finished by the next worker", function()
        local ended, violations = tq.crash_case(helpers.uri(), helpers.db_name(), p)
        assert.are.equal("injected", ended)
        assert.are.same({}, violations)
      end)
    end
  end
end)
