-- An adversarial second read of mongotx.queue (issue 12, part 2): what a
-- caller's edited job table, an odd error value or an odd policy does.
-- Each case asserts what the jobs collection holds afterwards.

local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local tq = require "torture.queue"

local nan = 0 / 0

local function fresh(opts)
  local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  local o = { backoff = function() return 0 end }
  for k, v in pairs(opts or {}) do o[k] = v end
  return assert(db:queue(o)), db
end

local function job_doc(q, id)
  return assert(q.jobs:find_one({ _id = id }))
end

describe("#server queue review", function()
  local q, db

  before_each(function() q, db = fresh({ max_attempts = 2 }) end)
  after_each(function() db:close() end)

  -- fn() returns nil and an `invalid` error of `step` and writes nothing
  local function invalid(step, fn, msg) helpers.assert_invalid(db, step, fn, msg) end

  it("fail counts the claims the job holds, not an attempts field the caller edited", function()
    assert(q:push("t", {}, { id = "j" }))
    assert.are.equal("ready", assert(q:fail(assert(q:claim("w")), "first")))
    local job = assert(q:claim("w"))
    assert.are.equal(2, job.attempts)
    -- with attempts edited down, the job must not get a third claim
    job.attempts = 1
    invalid("fail", function() return q:fail(job, "second") end, "attempts")
    assert.are.same({ "running", 2 }, { job_doc(q, "j").state, job_doc(q, "j").attempts })
    -- nor die early with attempts edited up, while it has claims left
    assert(q:push("t", {}, { id = "k" }))
    local k = assert(q:claim("w"))
    k.attempts = 99
    invalid("fail", function() return q:fail(k, "e") end, "attempts")
    assert.are.equal("running", job_doc(q, "k").state)
    -- the job as claimed fails as the policy says
    job.attempts = 2
    assert.are.equal("dead", assert(q:fail(job, "second")))
    assert.are.equal("dead", job_doc(q, "j").state)
  end)

  it("a job table whose epoch is no claim number gets invalid, not a raise from inside", function()
    assert(q:push("t", {}, { id = "j" }))
    local job = assert(q:claim("w"))
    for _, epoch in ipairs { 1.5, nan, 1 / 0, -1, 2 ^ 60 } do
      local forged = { _id = "j", epoch = epoch, attempts = 1 }
      invalid("heartbeat", function() return q:heartbeat(forged) end, "epoch")
      invalid("done", function() return q:done(forged) end, "epoch")
      invalid("fail", function() return q:fail(forged, "e") end, "epoch")
    end
    assert.are.same({ "running", 1 }, { job_doc(q, "j").state, job_doc(q, "j").epoch })
    assert.is_true(q:done(job))
  end)

  it("fail stores any error value, even one whose tostring raises, and work goes on", function()
    local odd = setmetatable({}, { __tostring = function() error("no text for this") end })
    local notext = setmetatable({}, { __tostring = function() return {} end })
    assert(q:push("t", {}, { id = "a" }))
    assert.are.equal("ready", assert(q:fail(assert(q:claim("w")), odd)))
    assert.are.equal("string", type(job_doc(q, "a").error))
    assert(q:push("u", {}, { id = "b" }))
    local stats, err = q:work({ t = function() error(odd) end, u = function() error(notext) end },
      { max_jobs = 3 })
    assert.is_nil(err)
    -- a's second claim is its last; b fails once, then dies
    assert.are.same({ done = 0, failed = 1, dead = 2, fenced = 0 }, stats)
    assert.are.same({ "dead", "dead" }, { job_doc(q, "a").state, job_doc(q, "b").state })
    assert.are.equal("string", type(job_doc(q, "b").error))
  end)

  it("db:queue refuses a lease of 0 seconds (every claim would expire at once)", function()
    local name = helpers.db_name()
    local other = assert(mongotx.connect(helpers.uri(), { database = name }))
    local res, err = other:queue { lease = 0 }
    assert.is_nil(res)
    assert.are.equal("invalid", err.code)
    assert.truthy(err.message:find("lease", 1, true), err.message)
    assert.are.equal("", helpers.db_dump(other.client, name))
    other:close()
  end)

  it("db:queue refuses unacknowledged writes (w = 0): claims and fencing need the replies", function()
    local name = helpers.db_name()
    local other = assert(mongotx.connect(helpers.uri(), { database = name }))
    local res, err = other:queue { write_concern = { w = 0 } }
    assert.is_nil(res)
    assert.are.equal("invalid", err.code)
    assert.truthy(err.message:find("write_concern.w", 1, true), err.message)
    assert.are.equal("", helpers.db_dump(other.client, name))
    assert(other:queue { write_concern = { w = 1 } })
    other:close()
  end)

  it("a heartbeat after the lease ended but before a requeue keeps the job (fencing is by epoch)", function()
    db:close()
    q, db = fresh({ lease = 0.2 })
    assert(q:push("t", {}, { id = "j" }))
    local job = assert(q:claim("w"))
    mongotx.core.sleep(0.4)
    assert(q:heartbeat(job))
    assert.are.same({ requeued = 0, dead = 0 }, assert(q:requeue_stale()))
    assert.is_true(q:done(job))
    assert.are.same({ "done", 1 }, { job_doc(q, "j").state, job_doc(q, "j").epoch })
  end)

  it("the torture check's re-reads cannot hide an effect applied twice", function()
    local targets = db:collection("targets")
    tq.prepare(targets)
    assert(q:push("effect", {}, { id = "j" }))
    local job = assert(q:claim("w"))
    assert(tq.effect(targets)(job))
    assert(q:done(job))
    assert.are.same({}, tq.check(q.jobs, targets, false))
    -- a second run that counted without the guard: n 2, one id
    assert(targets:update_one({ _id = tq.TARGET }, { ["$inc"] = { n = 1 } }))
    assert.are.same({ "counter 2 but 1 ids on the target" }, tq.check(q.jobs, targets, false))
    -- one that added the id again as well
    assert(targets:update_one({ _id = tq.TARGET }, { ["$push"] = { jobs = "j" } }))
    assert.are.same({ "effect of j applied twice" }, tq.check(q.jobs, targets, false))
    assert.are.same({ "effect of j applied twice" }, tq.check(q.jobs, targets, true))
  end)

  it("pushing the id of a finished job returns it as it is and runs nothing again", function()
    assert(q:push("t", { n = 1 }, { id = "d" }))
    assert(q:done(assert(q:claim("w")), "ok"))
    local again = assert(q:push("t", { n = 1 }, { id = "d" }))
    assert.are.same({ "done", 1 }, { again.state, again.epoch })
    assert.are.same({ ready = 0, running = 0, done = 1, dead = 0 }, assert(q:counts()))
    assert.is_false(q:claim("w"))
  end)

  it("work ends with the policy error when backoff fails; the job waits for its lease", function()
    db:close()
    q, db = fresh({ backoff = function() return 0 / 0 end })
    assert(q:push("t", {}, { id = "p" }))
    assert(q:push("t", {}, { id = "r" }))
    local stats, err = q:work({ t = function() return nil, "broken" end })
    assert.are.same({ done = 0, failed = 0, dead = 0, fenced = 0 }, stats)
    assert.are.equal("policy", err.code)
    local p = job_doc(q, "p")
    assert.are.same({ "running", "date" }, { p.state, mongotx.core.type(p.lease_until) })
    assert.are.equal("ready", job_doc(q, "r").state, "the loop claimed nothing more")
  end)

  it("work fails a job whose handler returns false, err (not done with false)", function()
    assert(q:push("t", {}, { id = "f" }))
    local stats = assert(q:work({ t = function() return false, "mail server down" end }, { max_jobs = 1 }))
    assert.are.same({ done = 0, failed = 1, dead = 0, fenced = 0 }, stats)
    local f = job_doc(q, "f")
    assert.are.same({ "ready", "mail server down" }, { f.state, f.error })
    -- a plain false (no error beside it) is a result like any other
    assert(q:work({ t = function() return false end }, { max_jobs = 1 }))
    assert.are.same({ "done", false }, { job_doc(q, "f").state, job_doc(q, "f").result })
  end)

  it("work finishes the job it claimed even when the handler edits its job table", function()
    assert(q:push("t", {}, { id = "a" }))
    assert(q:push("u", {}, { id = "b", priority = -1 }))
    local other = assert(q:claim("x", { "u" }))
    local stats, err = q:work({ t = function(job)
      job._id, job.epoch, job.attempts = other._id, other.epoch, 0
      return "ok"
    end }, { max_jobs = 1 })
    assert.is_nil(err)
    assert.are.same({ done = 1, failed = 0, dead = 0, fenced = 0 }, stats)
    assert.are.same({ "done", "ok" }, { job_doc(q, "a").state, job_doc(q, "a").result })
    assert.are.equal("running", job_doc(q, "b").state, "another worker's job is left alone")
    -- and one that breaks it entirely does not raise out of the loop
    assert(q:push("t", {}, { id = "c" }))
    stats, err = q:work({ t = function(job) job.epoch = nil; error("broken") end }, { max_jobs = 1 })
    assert.is_nil(err)
    assert.are.same({ done = 0, failed = 1, dead = 0, fenced = 0 }, stats)
    assert.are.same({ "ready", 1 }, { job_doc(q, "c").state, job_doc(q, "c").attempts })
  end)
end)
