-- mongotx.queue.worker: the queue's worker loop (work: claim, run the
-- handler, record its outcome, requeue expired leases while idle) and
-- run_one, its step for one claimed job; and claim_types, what a claim
-- takes of a list of job types.  The functions take the queue;
-- mongotx.queue makes them its methods.

-- (For LDoc this file is more of mongotx.queue's class Queue, as the C
-- files are more of mongotx.core: with `merge`, the reference is the
-- one it was before the split.)

--- The queue's worker loop (its methods `q:work` and `q:run_one`).
-- @module mongotx.queue

--- @type Queue

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"

local type, pcall, next, ipairs = type, pcall, next, ipairs
local rawget, rawlen = rawget, rawlen or function(t) return #t end
local format, floor = string.format, math.floor

local _M = {}

-- Levels for error(): a misuse is reported at the caller of the public
-- method (CALLER from the method, HELPER_CALLER from a helper it calls).
local CALLER, HELPER_CALLER = 2, 3

-- The types a claim takes: nil (any), or a non-empty list of types read
-- raw.  Returns the filter's value, or nil, err.
function _M.claim_types(types, step)
  if types == nil then return nil end
  if type(types) ~= "table" then error(step .. ": types must be a list of strings", HELPER_CALLER) end
  local n, list = rawlen(types), {}
  if n == 0 then return false, errors.new("invalid", step .. ": types is an empty list", { step = step }) end
  for i = 1, n do
    local t = rawget(types, i)
    if type(t) ~= "string" or t == "" then
      return false, errors.new("invalid", format("%s: types[%d] must be a job type (a " ..
        "non-empty string)", step, i), { step = step })
    end
    list[i] = t
  end
  for k in next, types do
    if type(k) ~= "number" or k < 1 or k > n or floor(k) ~= k then
      return false, errors.new("invalid", step .. ": types must be a list (keys 1..n)", { step = step })
    end
  end
  return { ["$in"] = list }
end

-- Runs handler on a claimed job and records the outcome: "done",
-- "failed" (ready again) or "dead"; nil, err (`fenced` when the job was
-- taken meanwhile).  A result that cannot be stored fails the job, and so
-- does nil or false with an error beside it.  The outcome is recorded
-- with the claim's own reference to the job, so that a handler that edits
-- its job table cannot finish another job (or break the loop).

--- Internal (used by `work`): runs a handler on a claimed job and records the outcome.
-- @local
-- @syntax outcome, err = q:run_one(handler, job)
-- @func handler `handler(job, queue)`
-- @tparam table job the claimed job
-- @treturn string "done", "failed" or "dead"
-- @errors `fenced`, database errors
-- @usage -- see work
-- @function Queue:run_one
function _M.run_one(self, handler, job)
  local claimed = { _id = job._id, epoch = job.epoch, attempts = job.attempts }
  local ok, res, herr = pcall(handler, job, self)
  local state, err
  if ok and (res or herr == nil) then
    state, err = self:done(claimed, res)
    if state then return "done" end
    if err.code ~= "invalid" then return nil, err end
    herr = err
  end
  state, err = self:fail(claimed, ok and herr or res)
  if state == "ready" then return "failed" end
  return state, err
end

local work_options = { worker = true, types = true, idle = true, poll = true,
                       max_jobs = true, stop = true }

-- work(handlers [, { worker, types, idle, poll, max_jobs, stop }]): a
-- worker loop.  handlers maps job types to function(job, queue) that
-- return a result (anything storable; nil counts as success) or nil (or
-- false), err, or raise; the job is then done or failed.  The loop claims only the
-- types of `types` (default: every type handlers has), runs
-- requeue_stale() whenever it finds nothing to claim, and stops when the
-- queue had nothing for `idle` seconds (default 0: at the first empty
-- claim; it polls every `poll` seconds, default 0.5), after `max_jobs`
-- jobs, or when stop() returns true (asked before each claim).  Returns
-- { done, failed, dead, fenced } counts, or those counts and err for a
-- database failure or a backoff policy that failed, which ends the loop
-- (that job stays running until its lease ends).

--- A worker loop: claims jobs of the handlers' types and runs them.
-- @syntax counts, err = q:work(handlers [, { worker, types, idle, poll, max_jobs, stop }])
-- @tparam table handlers `handlers[type](job, queue)`: a result (done), or nil, err / a raise (fail)
-- @tparam[opt] table opts `idle` (seconds with nothing to claim before it returns, default 0), `poll`, `max_jobs`,
--   `stop()`
-- @treturn table `{ done, failed, dead, fenced }`
-- @errors the counts and err for a database or backoff failure
-- @usage local r = q:work({ mail = send_mail }, { idle = 5 })
-- @function Queue:work
function _M.work(self, handlers, opts)
  if type(handlers) ~= "table" then error("work: handlers must be a table", CALLER) end
  local why
  opts, why = validate.options(opts, work_options, "work", CALLER)
  if not opts then return nil, why end
  local fns, names = {}, {}
  for k, fn in next, handlers do
    if type(k) ~= "string" or type(fn) ~= "function" then
      error("work: handlers maps job types (strings) to functions", CALLER)
    end
    fns[k], names[#names + 1] = fn, k
  end
  local types = opts.types or names
  local of
  of, why = _M.claim_types(types, "work")
  if of == false then return nil, why end
  for _, t in ipairs(of["$in"]) do
    if not fns[t] then
      return nil, errors.new("invalid", "work: no handler for the type " .. t, { step = "work" })
    end
  end
  local worker = opts.worker or ("worker-" .. core.ObjectId():value())
  local idle, poll = opts.idle or 0, opts.poll or 0.5
  local stats = { done = 0, failed = 0, dead = 0, fenced = 0 }
  local empty_since, requeued_at
  while not (opts.max_jobs and stats.done + stats.failed + stats.dead + stats.fenced >= opts.max_jobs)
        and not (opts.stop and opts.stop()) do
    local err
    -- expired leases are requeued once a lease, busy or not, so that a
    -- dead worker's jobs do not wait for the queue to run dry
    local now = core.monotonic_ms()
    local requeued = 0
    if not requeued_at or now - requeued_at >= self.policy.lease * 1000 then
      local res
      res, err = self:requeue_stale()
      if not res then return stats, err end
      requeued, requeued_at = res.requeued, now
    end
    local job
    job, err = self:claim(worker, of["$in"])
    if job == nil then return stats, err end
    if job then
      empty_since = nil
      local state
      state, err = self:run_one(fns[job.type], job)
      if state then
        stats[state] = stats[state] + 1
      elseif err.code == "fenced" then
        stats.fenced = stats.fenced + 1
      else
        return stats, err
      end
    elseif requeued == 0 then
      empty_since = empty_since or now
      if now - empty_since >= idle * 1000 then break end
      core.sleep(poll)
      requeued_at = nil -- look for expired leases before the next claim
    end
  end
  return stats
end

return _M
