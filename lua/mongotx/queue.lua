-- mongotx.queue: a job queue in a MongoDB collection (seed 002's second
-- pattern).  Work that spans documents is pushed as one job document;
-- workers claim jobs with findAndModify, run a handler that applies the
-- job's effect idempotently, and mark the job done.  A worker that dies
-- leaves its job `running` with a lease by the server's clock; once the
-- lease expired, requeue_stale() makes the job ready again (or dead after
-- max_attempts claims), and another worker runs it from the start.
--
--   local q = assert(db:queue{ collection = "jobs" })
--   q:push("befriend", { a = "A", b = "B" }, { id = "A+B" })
--   q:work({ befriend = function(job) ... end }, { idle = 0 })
--
-- States: ready -> running -> done, or running -> ready (fail with
-- attempts left, or an expired lease) -> ... -> dead.  Each claim raises
-- the job's `epoch`; heartbeat, done and fail match the job by (_id,
-- epoch, state running), so a worker whose job was requeued or taken by
-- another worker gets `fenced` and changes nothing.  Delivery is
-- at-least-once: a handler may run twice for one job (its worker stalled
-- past the lease, or died after the effect and before done), so the
-- effect is exactly-once only when the handler is idempotent (docs/queue.md).
--
-- Fields of a job: _id, type, details, priority, state, ts (server time
-- from which a ready job may be claimed; claims take the highest priority,
-- then the oldest ts), created, attempts (claims so far), epoch, worker,
-- claimed and lease_until (the last claim), error (the last failure),
-- result and finished (done), and for dead jobs `died`.
--
-- This module owns the queue object and the job API (push, claim,
-- heartbeat, done, fail, requeue_stale, get, counts); the worker loop
-- (work, run_one) is mongotx.queue.worker.

--- A job queue in a collection: `db:queue(opts)` returns one (docs/queue.md).
-- @module mongotx.queue

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local clock = require "mongotx.clock"
local points = require "mongotx.points"
local loop = require "mongotx.queue.worker"

local type, tostring, setmetatable, pcall, next = type, tostring, setmetatable, pcall, next
local rawget = rawget
local format, floor, Date = string.format, math.floor, core.Date

local _M = {}

-- The policies of a queue, with their defaults; db:queue{...} replaces any
-- of them.
_M.policy = {
  -- Seconds a claim (or the last heartbeat) holds a job.  A handler that
  -- runs longer must call heartbeat(job) within each lease.
  lease = 30,
  -- Claims a job gets: a job that failed (or whose lease expired) this
  -- many times is dead-lettered (state dead) instead of made ready again.
  max_attempts = 5,
  -- Seconds a failed job waits before it is ready again, after its
  -- `attempts`th claim failed with `err` (what the handler returned or
  -- raised): 1, 2, 4, ... up to an hour.
  backoff = function(attempts, err) -- luacheck: no unused args
    return math.min(2 ^ (attempts - 1), 3600)
  end,
}

-- Levels for error(): a misuse is reported at the caller of the public
-- method (CALLER from the method, HELPER_CALLER from a helper it calls).
local CALLER, HELPER_CALLER = 2, 3

local Queue = {}
Queue.__index = Queue

local queue_options = { collection = true, write_concern = true, lease = true,
                        max_attempts = true, backoff = true }

local function invalid(step, message)
  return nil, errors.new("invalid", message, { step = step })
end

-- A validation error (validate names its own step) as this call's.
local function refused(err, step)
  err.step = step
  return nil, err
end

-- A ready job's place in the claim order; the index serves the claim's
-- filter and sort.
local CLAIM_ORDER = core.doc("state", 1, "priority", -1, "ts", 1)
-- requeue_stale's filter: running jobs by the end of their lease.
local LEASE_INDEX = core.doc("state", 1, "lease_until", 1)

-- db:queue{ collection = "jobs", write_concern, lease, max_attempts,
-- backoff }: a queue on that collection (its indexes created), or nil, err.
function _M.new(db, opts)
  local why
  opts, why = validate.options(opts, queue_options, "queue", HELPER_CALLER)
  if not opts then return nil, why end
  -- a lease of 0 ends at the claim: every running job would be requeued
  -- (and run again) by the next requeue_stale, however alive its worker
  if opts.lease == 0 then
    return invalid("queue", "option lease of queue must be a number of seconds above 0, not 0")
  end
  local policy = {}
  for k, v in next, _M.policy do
    if opts[k] ~= nil then policy[k] = opts[k] else policy[k] = v end
  end
  local jobs = db.client:collection(db.name, opts.collection or "jobs")
  local self = setmetatable({
    db = db,
    jobs = jobs,
    policy = policy,
    clock = clock.new(db),
    wopts = { write_concern = opts.write_concern or { w = "majority", j = true } },
  }, Queue)
  for _, keys in ipairs { CLAIM_ORDER, LEASE_INDEX } do
    local ok, err = jobs:create_index(keys)
    if not ok then return nil, errors.wrap(err, "queue") end
  end
  return self
end

-- The server's time `seconds` from now, as a Date; nil, err.

--- @type Queue

--- Internal: the server's time `seconds` from now, as a Date.
-- @local
-- @syntax date, err = q:at(seconds)
-- @number seconds from now
-- @treturn userdata a Date
-- @errors database errors
-- @usage local when = assert(q:at(60))
function Queue:at(seconds)
  local now, err = self.clock:now()
  if not now then return nil, err end
  return Date(floor(now + seconds * 1000))
end

-- Runs one write on the jobs between its crash points (queue.<step>,
-- before and after), with the step named in its error.

--- Internal: one write on the jobs between its crash points.
-- @local
-- @syntax ... = q:write(step, fn, ...)
-- @string step the step's name (`push`, `claim`, ...)
-- @func fn the write
-- @param ... its arguments
-- @return what fn returns
-- @errors fn's, named with the step
-- @usage -- used by push, claim, heartbeat, done, fail, requeue_stale
function Queue:write(step, fn, ...)
  return points.write("queue", step, fn, self.jobs, ...)
end

-- The largest epoch a job can reach: claims raise it by one, and a job
-- has at most max_attempts (options.lua: a million) of them.
local MAX_EPOCH = 2147483647

-- A job table passed back by a caller: its id as it goes into a filter and
-- its epoch.  Not a job (no _id, no numeric epoch) raises; an epoch no
-- claim gives (fractional, NaN, negative, huge) is `invalid`.
local function job_ref(job, step)
  if type(job) ~= "table" or rawget(job, "_id") == nil or type(rawget(job, "epoch")) ~= "number" then
    error(step .. " expects a job returned by claim (a table with _id and epoch)", HELPER_CALLER)
  end
  local id, why = validate.check_id(rawget(job, "_id"))
  if id == nil then return refused(why, step) end
  local epoch = rawget(job, "epoch")
  if not (epoch >= 0 and epoch <= MAX_EPOCH and floor(epoch) == epoch) then
    return invalid(step, format("%s: the job's epoch must be a whole number from 0 to %d " ..
      "(as claim returned it), not %s", step, MAX_EPOCH, tostring(epoch)))
  end
  return id, epoch
end

local function held_filter(id, epoch, attempts)
  return { _id = id, epoch = epoch, state = "running", attempts = attempts }
end

-- The write of heartbeat, done or fail on the job held at `epoch` (and,
-- for fail, with `attempts` claims): true, or false when no job matched
-- (fenced, or a caller's edited attempts), or nil, err.

--- Internal: the write of heartbeat, done or fail on the job held at `epoch`.
-- @local
-- @syntax ok, err = q:held_write(step, id, epoch, update [, attempts])
-- @string step the step
-- @param id the job's id
-- @int epoch the claim's epoch
-- @tparam table update the update
-- @int[opt] attempts for fail: the claim count the job must have
-- @treturn boolean true, or false when no job matched
-- @errors database errors
-- @usage -- used by heartbeat, done and fail
function Queue:held_write(step, id, epoch, update, attempts)
  local res, err = self:write(step, self.jobs.update_one, held_filter(id, epoch, attempts),
    update, self.wopts)
  if not res then return nil, err end
  return res.matched == 1
end

-- The `fenced` error of a job that is no longer held at `epoch`, saying
-- what became of it.

--- Internal: the `fenced` error of a job no longer held at `epoch`.
-- @local
-- @syntax err = q:fenced(step, id, epoch)
-- @string step the step
-- @param id the job's id
-- @int epoch the claim's epoch
-- @treturn table the error
-- @usage -- used by heartbeat, done and fail
function Queue:fenced(step, id, epoch)
  local doc, err = self.jobs:find_one({ _id = id }, { projection = { state = 1, epoch = 1 } })
  if err then return nil, errors.wrap(err, step) end
  local now = doc and format("it is %s at epoch %s", tostring(doc.state), tostring(doc.epoch))
              or "it no longer exists"
  return nil, errors.new("fenced", format("this worker no longer holds the job (claimed " ..
    "at epoch %d; %s): its lease expired and it was requeued or taken", epoch, now),
    { step = step, id = id })
end

-- push(type, details [, { id, at, priority }]): adds a ready job and
-- returns it.  details: any storable value (no `$` or dotted keys).  id
-- makes push idempotent: pushing an id again returns the existing job if
-- type and details are the same, else an `idempotency` error.  at: seconds
-- from now (server's clock) before the job may be claimed; priority: a
-- whole number, higher first (default 0).
local push_options = { id = true, at = true, priority = true }

--- Inserts a `ready` job.
-- @syntax job, err = q:push(type, details [, { id, at, priority }])
-- @string kind the job type (the handler's name)
-- @param details any storable value
-- @tparam[opt] table opts `id` (pushing it again returns the same job), `at` (seconds from now), `priority`
--   (higher first)
-- @treturn table the job
-- @errors `invalid`, `idempotency` (the id names another job), database errors
-- @usage q:push("befriend", { a = "A", b = "B" }, { id = "A+B" })
function Queue:push(kind, details, opts)
  if type(kind) ~= "string" then error("push: type must be a string", CALLER) end
  local why
  opts, why = validate.options(opts, push_options, "push", CALLER)
  if not opts then return nil, why end
  if not options.text_ok(kind) or kind:find("%z") then
    return invalid("push", "push: type must be a non-empty UTF-8 string without NUL")
  end
  local stored
  stored, why = validate.value(details)
  if details ~= nil and stored == nil then return invalid("push", "push: details: " .. why) end
  local id = opts.id
  if id == nil then
    id = core.ObjectId()
  else
    id, why = validate.check_id(id)
    if id == nil then return refused(why, "push") end
  end
  local now, err = self.clock:now()
  if not now then return nil, err end
  local job = { _id = id, type = kind, details = stored, priority = opts.priority or 0,
                state = "ready", ts = Date(floor(now + (opts.at or 0) * 1000)),
                created = Date(floor(now)), attempts = 0, epoch = 0 }
  local fits
  fits, err = validate.fits(job, "push: details", "queue", "push", id)
  if not fits then return nil, err end
  local res
  res, err = self:write("push", self.jobs.insert_one, job, self.wopts)
  if res then return job end
  if err.server_code ~= 11000 then return nil, err end
  local existing
  existing, err = self.jobs:find_one({ _id = id })
  if not existing then return nil, errors.wrap(err, "push", id) end
  if existing.type == kind and validate.canon(existing.details) == validate.canon(stored) then
    return existing
  end
  return nil, errors.new("idempotency", "push: this job id was used for another job",
    { step = "push", id = id })
end

-- claim(worker [, types]): the ready job of the highest priority whose
-- time came (oldest first), of one of these types, now running for
-- `worker` with a lease; false when there is none, or nil, err.

--- Takes the ready job of highest priority, oldest first, for `worker`, with a lease.
-- @syntax job, err = q:claim(worker [, types])
-- @string worker this worker's name
-- @tparam[opt] table types the job types it takes
-- @treturn table|boolean the job (`running`), or false when none is ready
-- @errors database errors
-- @usage local job = q:claim("w1")
function Queue:claim(worker, types)
  if type(worker) ~= "string" then error("claim: worker must be a string", CALLER) end
  if not options.text_ok(worker) then
    return invalid("claim", "claim: worker must be a non-empty UTF-8 string")
  end
  local of, why = loop.claim_types(types, "claim")
  if of == false then return nil, why end
  local now, err = self.clock:now()
  if not now then return nil, err end
  local filter = { state = "ready", ts = { ["$lte"] = Date(floor(now)) }, type = of }
  local res
  res, err = self:write("claim", self.jobs.find_and_modify, filter, {
    sort = CLAIM_ORDER, new = true, write_concern = self.wopts.write_concern,
    update = { ["$set"] = { state = "running", worker = worker, claimed = Date(floor(now)),
                            lease_until = Date(floor(now + self.policy.lease * 1000)) },
               ["$inc"] = { epoch = 1, attempts = 1 } } })
  if not res then return nil, err end
  return res.value or false
end

-- heartbeat(job): extends the lease of a job this worker holds by
-- `lease` seconds; the new end of the lease (a Date), or nil and a
-- `fenced` error when the job was requeued or taken meanwhile.

--- Extends the lease of a job this worker holds.
-- @syntax until_, err = q:heartbeat(job)
-- @tparam table job the claimed job
-- @treturn userdata the lease's new end (a Date)
-- @errors `fenced` (requeued or taken meanwhile), `invalid`, database errors
-- @usage assert(q:heartbeat(job))
function Queue:heartbeat(job)
  local id, epoch = job_ref(job, "heartbeat")
  if id == nil then return nil, epoch end
  local until_, err = self:at(self.policy.lease)
  if not until_ then return nil, err end
  local held
  held, err = self:held_write("heartbeat", id, epoch, { ["$set"] = { lease_until = until_ } })
  if held == nil then return nil, err end
  if not held then return self:fenced("heartbeat", id, epoch) end
  return until_
end

-- done(job [, result]): the job this worker holds is done (result, any
-- storable value, kept on it).  true; true again for a repeated done of
-- the same claim; nil and `fenced` when the job was requeued or taken.

--- Marks a job this worker holds `done`.
-- @syntax ok, err = q:done(job [, result])
-- @tparam table job the claimed job
-- @param[opt] result kept on the job
-- @treturn boolean true (also for a repeat of the same claim's done)
-- @errors `fenced`, `invalid`, database errors
-- @usage assert(q:done(job, { sent = true }))
function Queue:done(job, result)
  local id, epoch = job_ref(job, "done")
  if id == nil then return nil, epoch end
  local stored, why = validate.value(result)
  if result ~= nil and stored == nil then return invalid("done", "done: result: " .. why) end
  local now, err = self.clock:now()
  if not now then return nil, err end
  local set = { state = "done", finished = Date(floor(now)), result = stored }
  local update = { ["$set"] = set, ["$unset"] = { lease_until = "" } }
  local held
  held, err = validate.fits({ q = held_filter(id, epoch), u = update }, "done: result",
    "queue", "done", id)
  if not held then return nil, err end
  held, err = self:held_write("done", id, epoch, update)
  if held == nil then return nil, err end
  if held then return true end
  local doc = self.jobs:find_one({ _id = id, epoch = epoch, state = "done" })
  if doc then return true end
  return self:fenced("done", id, epoch)
end

-- A failure as stored on the job: a string of at most 4 KiB.
local MAX_ERROR = 4096

-- The handler's error as text: its message when it is a table that has
-- one, else tostring of it; a value whose __tostring raises or gives no
-- string is named by its type (fail must record every failure).
local function describe(err)
  local s = type(err) == "table" and rawget(err, "message") or err
  local ok, text = pcall(tostring, s)
  if not ok or type(text) ~= "string" then text = "a " .. type(s) .. " with no text" end
  if #text > MAX_ERROR then text = text:sub(1, MAX_ERROR) end
  return text
end

-- fail(job, err): the handler of a job this worker holds failed with err
-- (kept on the job as a string).  With attempts left the job is ready
-- again after backoff(attempts, err) seconds, else dead.  Returns the new
-- state ("ready" or "dead"), or nil and `fenced` (job requeued or taken),
-- `invalid` (the job table's attempts are not its claim's) or `policy`
-- (backoff raised or returned no duration): nothing written.

--- Records a handler's failure: the job is ready again after the backoff, or dead.
-- @syntax state, err = q:fail(job, err)
-- @tparam table job the claimed job
-- @param err the failure (kept as a string)
-- @treturn string "ready" or "dead"
-- @errors `fenced`, `invalid` (edited attempts), `policy` (backoff failed), database errors
-- @usage q:fail(job, "smtp timeout")
function Queue:fail(job, err)
  local id, epoch = job_ref(job, "fail")
  if id == nil then return nil, epoch end
  local attempts = rawget(job, "attempts")
  if type(attempts) ~= "number" then error("fail expects a job returned by claim", CALLER) end
  -- a count no claim gives (NaN, fractional, out of range) would reach
  -- the backoff policy, and its refusal would read as the policy's fault
  if not (attempts >= 1 and attempts <= MAX_EPOCH and floor(attempts) == attempts) then
    return invalid("fail", format("fail: the job's attempts must be a whole number from 1 to %d " ..
      "(as claim returned it), not %s", MAX_EPOCH, tostring(attempts)))
  end
  local message = describe(err)
  local now, why = self.clock:now()
  if not now then return nil, why end
  local set = { error = message }
  if attempts >= self.policy.max_attempts then
    set.state, set.died = "dead", Date(floor(now))
  else
    local ok, wait = pcall(self.policy.backoff, attempts, err)
    if not ok or type(wait) ~= "number" or not (wait >= 0 and wait <= 10 * 365 * 86400) then
      return nil, errors.new("policy", "backoff must return a number of seconds, not " ..
        tostring(wait), { step = "fail", id = id })
    end
    set.state, set.ts = "ready", Date(floor(now + wait * 1000))
  end
  -- the write is conditioned on the claims the job had, so that a job
  -- table whose attempts were edited cannot keep a job from dying (or
  -- kill it early): the decision above holds only for that count
  local held
  held, why = self:held_write("fail", id, epoch, { ["$set"] = set, ["$unset"] = { lease_until = "" } },
    attempts)
  if held == nil then return nil, why end
  if held then return set.state end
  local doc = self.jobs:find_one({ _id = id, epoch = epoch, state = "running" })
  if doc then
    return invalid("fail", format("fail: the job's attempts (%s) are not those of its claim " ..
      "(%s): pass the job as claim returned it", tostring(attempts), tostring(doc.attempts)))
  end
  return self:fenced("fail", id, epoch)
end

-- requeue_stale(): the running jobs whose lease expired (by the server's
-- clock) become ready at once (keeping their ts: they have waited
-- longest), or dead when they had max_attempts claims.
-- Returns { requeued = n, dead = n }, or nil, err.  Safe to run anywhere,
-- any time, by many processes: each change is one conditional write.

--- Running jobs whose lease expired become ready (or dead after `max_attempts` claims).
-- @syntax counts, err = q:requeue_stale()
-- @treturn table `{ requeued, dead }`
-- @errors database errors
-- @usage local r = assert(q:requeue_stale())
function Queue:requeue_stale()
  local now, err = self:at(0)
  if not now then return nil, err end
  local expired = { state = "running", lease_until = { ["$lt"] = now } }
  local dead_filter = { state = "running", lease_until = { ["$lt"] = now },
                        attempts = { ["$gte"] = self.policy.max_attempts } }
  local dead, requeued
  dead, err = self:write("requeue", self.jobs.update_many, dead_filter,
    { ["$set"] = { state = "dead", died = now, error = "lease expired" },
      ["$unset"] = { lease_until = "" } }, self.wopts)
  if not dead then return nil, err end
  requeued, err = self:write("requeue", self.jobs.update_many, expired,
    { ["$set"] = { state = "ready", error = "lease expired" },
      ["$unset"] = { lease_until = "" } }, self.wopts)
  if not requeued then return nil, err end
  return { requeued = requeued.modified or requeued.matched, dead = dead.modified or dead.matched }
end

-- The job with this id, or nil; nil, err.

--- The job with this id.
-- @syntax job, err = q:get(id)
-- @param id the job's id
-- @treturn ?table the job, or nil
-- @errors database errors
-- @usage local job = q:get("A+B")
function Queue:get(id)
  local sent, why = validate.check_id(id)
  if sent == nil then return refused(why, "get") end
  local doc, err = self.jobs:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "get", id) end
  return doc
end

-- The number of jobs in each state: { ready = n, running = n, done = n,
-- dead = n }, or nil, err.

--- The number of jobs in each state.
-- @syntax counts, err = q:counts()
-- @treturn table `{ ready, running, done, dead }`
-- @errors database errors
-- @usage local c = assert(q:counts())
function Queue:counts()
  local out = {}
  for _, state in ipairs { "ready", "running", "done", "dead" } do
    local n, err = self.jobs:count({ state = state })
    if not n then return nil, errors.wrap(err, "counts") end
    out[state] = n
  end
  return out
end

-- The worker loop (run_one, work): mongotx.queue.worker.
Queue.run_one, Queue.work = loop.run_one, loop.work

return _M
