-- Resumable batch jobs (tm:each): one transaction per item of a list or
-- a cursor, committed batch by batch through tm:commit_many, each under an
-- id derived from the job's id and the item's key (job_text below).  A run that is killed
-- at any moment is finished by running the same job again:
--
--   * before anything of a batch is computed, one read finds the
--     transactions an earlier run left under the batch's ids.  `done` ones
--     are skipped (fn is not even called: the item may have changed since,
--     by the job itself), `cancelled` ones stay cancelled (an id is never
--     reused), and the ones left in flight are finished now through the
--     manager's public calls: `applied` (past the commit point) at once,
--     `initial`/`pending`/`canceling` once the ownership policy and the
--     killed run's deadline let this manager claim them (see wait below);
--   * only the items without a transaction go to fn and commit_many, so a
--     re-run applies nothing twice and spends one read per batch on the
--     check.
--
-- Everything of a batch (keys, fn, the checks of each item's ops) is
-- computed before the batch writes anything: bad input in a batch returns
-- nil, err with nothing of that batch written, and the batches before it
-- stay committed (err.report says how far the job got).
--
-- Why not take the killed run's pending transactions over at once: a run
-- that only looks dead (stopped, cut off from the server) may still apply
-- their ops until its deadline, and the claim is refused before it (the
-- fencing of mongotx.batch).  So a re-run waits for those, at most
-- opts.wait seconds (default lease + stale_after), after it has done
-- everything else; what is still held then is reported failed (`owned`)
-- and the next run finishes it.
--
-- A job must not outlive the retention of its transactions (prune): an
-- item whose transaction was pruned looks new to a re-run.  Jobs that may
-- be re-run after that long put a guard in their ops (examples/06).

--- Resumable batch jobs: the work of `tm:each` (docs/transactions.md#each).
-- @module mongotx.each

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local options = require "mongotx.options"
local engine = require "mongotx.engine"

local type, ipairs, tostring, rawget = type, ipairs, tostring, rawget
local format = string.format
local monotonic_ms = core.monotonic_ms

local _M = {}

local each_options = { id = true, key = true, batch = true, progress = true, wait = true }

-- Seconds between two tries at claiming an earlier run's transaction.
local POLL = 0.25

-- Items one at a time from a list (read raw, up to its first nil) or a
-- cursor (anything with a next method, like what the core's find()
-- returns): next() returns an item, nil at the end, or nil, err when the
-- cursor failed.
local function items_of(source, level)
  local kind, step = type(source), nil
  if kind == "userdata" or (kind == "table" and type(source.next) == "function") then
    step = function() return source:next() end
  elseif kind == "table" then
    local i = 0
    step = function()
      i = i + 1
      return rawget(source, i)
    end
  else
    error("each takes a list or a cursor, not a " .. kind, level)
  end
  local ended = false
  return function() -- nil for good after the first nil (a cursor would raise)
    if ended then return nil end
    local item, err = step()
    ended = item == nil
    return item, err
  end
end

-- The key of an item as part of a transaction id: a string or a finite
-- number, in the server's canonical form (1 and 1.0 are one key, "1"
-- another).
local function key_text(k)
  local t = type(k)
  if t == "string" or (t == "number" and k == k and k ~= math.huge and k ~= -math.huge) then
    return core.id_key(k)
  end
  return nil, format("the key must be a string or a finite number, not %s",
    t == "number" and tostring(k) or (k == nil and "nil" or "a " .. t))
end

-- The job's id as the first part of a transaction id: "/" and "%" are
-- written %2F and %25, so that the first "/" of <job>/<key> always ends
-- the job's part and two different (job, key) pairs never share an id
-- (job "a" with key "/s1:z" and job "a/s5:" with key "z" would).
local ESCAPED = { ["%"] = "%25", ["/"] = "%2F" }
local function job_text(job)
  return (job:gsub("[%%/]", ESCAPED))
end

local function new_report()
  return { items = 0, batches = 0, committed = 0, skipped = 0, excluded = 0, recovered = 0,
           cancelled = 0, failed = 0, cancellations = {}, failures = {} }
end

-- e's transaction T (as stored: its reason and cause) ended cancelled:
-- the same entry whichever run meets it.
local function cancelled(report, e, T, earlier)
  report.cancelled = report.cancelled + 1
  report.cancellations[#report.cancellations + 1] = { key = e.key, id = e.id,
    reason = T.reason, cause = engine.cause_of(T.reason, T.cause), earlier = earlier }
end

local function failed(report, e, err)
  report.failed = report.failed + 1
  report.failures[#report.failures + 1] = { key = e.key, id = e.id, error = err }
end

-- An invalid item: nil, err naming it, with the report so far.
local function bad_item(report, n, k, message)
  return nil, errors.new("invalid", format("each: item %d%s: %s", n,
    k ~= nil and (" (key " .. tostring(k) .. ")") or "", message),
    { step = "each", report = report })
end

-- Drives an earlier run's transaction T (claimed or committed) to its end
-- with tm:commit and counts the outcome; true (it is settled).
local function finish_earlier(tm, report, e, T)
  local final, err = tm:commit(T)
  if final then
    report.committed, report.recovered = report.committed + 1, report.recovered + 1
    return true
  end
  local now = tm:get(e.id)
  if now and now.state == "cancelled" then
    report.recovered = report.recovered + 1
    cancelled(report, e, now, false)
    return true
  end
  failed(report, e, err)
  return true
end

-- An earlier run's transaction in flight: claimed under the ownership
-- policy (false while its holder's lease or deadline runs: try later),
-- then finished.
local function settle_earlier(tm, report, e, T)
  if T.parked then
    failed(report, e, errors.new("state", "parked: " .. tostring(T.reason),
      { step = "each", id = e.id }))
    return true
  end
  if T.state == "applied" then return finish_earlier(tm, report, e, T) end
  local claimed, err = tm:step("claim", T)
  if claimed then return finish_earlier(tm, report, e, claimed) end
  if claimed == false or err.code == "owned" then return false end
  if err.code == "state" then -- it finished meanwhile: look again
    local again = tm:get(e.id)
    if again and (again.state == "done" or again.state == "cancelled") then
      return finish_earlier(tm, report, e, again)
    end
  end
  failed(report, e, err)
  return true
end

-- Classifies what an earlier run left for the entries of one batch;
-- returns the entries that are new (no transaction yet) and the ones in
-- flight.
local function earlier(tm, report, entries)
  local ids = {}
  for i, e in ipairs(entries) do ids[i] = e.id end
  local found, err = tm:find({ _id = { ["$in"] = ids } }, { limit = #ids, sort = { _id = 1 } })
  if not found then return nil, err end
  local by_id = {}
  for _, T in ipairs(found) do by_id[T._id] = T end
  local new, flying = {}, {}
  for _, e in ipairs(entries) do
    local T = by_id[e.id]
    if not T then
      new[#new + 1] = e
    elseif T.state == "done" then
      report.skipped = report.skipped + 1
    elseif T.state == "cancelled" then
      cancelled(report, e, T, true)
    else
      e.T = T
      flying[#flying + 1] = e
    end
  end
  return new, flying
end

-- Runs the new entries of a batch with commit_many and counts them.  An
-- error that is not the end of a cancelled transaction is read back:
-- cancelled, or failed (left for the next run).
local function commit_new(tm, report, todo)
  local list = {}
  for i, e in ipairs(todo) do list[i] = { ops = e.ops, id = e.id, meta = e.meta } end
  local results, errs = tm:commit_many(list)
  local unsure, unsure_ids = {}, {}
  for i, e in ipairs(todo) do
    if results[i] then
      report.committed = report.committed + 1
    else
      unsure[#unsure + 1], unsure_ids[#unsure_ids + 1] = { e = e, err = errs[i] }, e.id
    end
  end
  if #unsure == 0 then return end
  local found, err = tm:find({ _id = { ["$in"] = unsure_ids } },
                              { projection = { state = 1, reason = 1, cause = 1 },
                                limit = #unsure_ids, sort = { _id = 1 } })
  local state = {}
  for _, T in ipairs(found or {}) do state[T._id] = T end
  for _, u in ipairs(unsure) do
    local T = state[u.e.id]
    if T and T.state == "cancelled" then
      cancelled(report, u.e, T, false)
    else
      failed(report, u.e, found and u.err or err)
    end
  end
end

-- Reads the next batch: entries { item, key, id, ops, meta } for the
-- items fn returned ops for.  Returns entries, or false at the end, or
-- nil, err (bad input, a failed cursor) before anything is written.
local function read_batch(report, job, next_item, opts, seen)
  local entries, size = {}, 0
  while size < opts.batch do
    local item, err = next_item()
    if item == nil then
      if err then
        err = errors.wrap(err, "each")
        err.report = report
        return nil, err
      end
      break
    end
    size = size + 1
    local n = report.items + size
    local k = opts.key(item)
    local text, why = key_text(k)
    if not text then return bad_item(report, n, nil, why) end
    if seen[text] then
      return bad_item(report, n, k, format("the key repeats item %d's", seen[text]))
    end
    seen[text] = n
    entries[#entries + 1] = { item = item, key = k, id = job .. "/" .. text, n = n }
  end
  if size == 0 then return false end
  report.items = report.items + size
  return entries
end

-- Calls fn for the new entries and checks what it returns the way
-- commit_many would; nil, err for the first bad one (nothing written).
local function prepare(tm, report, new, fn, level)
  local todo = {}
  for _, e in ipairs(new) do
    local ops, meta = fn(e.item)
    if ops == nil then
      report.excluded = report.excluded + 1
    else
      if type(ops) ~= "table" then
        error(format("each: fn returned a %s for item %d, not a list of ops or nil",
          type(ops), e.n), level)
      end
      if meta ~= nil and type(meta) ~= "table" then
        error(format("each: fn returned a %s meta for item %d, not a table or nil",
          type(meta), e.n), level)
      end
      local ok, err = tm:check(ops, { id = e.id, meta = meta })
      if not ok then return bad_item(report, e.n, e.key, err.message) end
      e.ops, e.meta = ops, meta
      todo[#todo + 1] = e
    end
  end
  return todo
end

-- The earlier run's transactions still held: tried again every POLL
-- seconds until each is claimed or `wait` seconds passed.
local function await_earlier(tm, report, held, wait)
  local give_up = monotonic_ms() + wait * 1000
  while #held > 0 do
    local still = {}
    for _, e in ipairs(held) do
      local T, err = tm:get(e.id)
      if not T then
        failed(report, e, err or errors.disappeared(e.id, "each"))
      elseif T.state == "done" then
        report.skipped = report.skipped + 1
      elseif T.state == "cancelled" then
        cancelled(report, e, T, true)
      elseif not settle_earlier(tm, report, e, T) then
        still[#still + 1] = e
      end
    end
    held = still
    if #held > 0 and monotonic_ms() >= give_up then
      for _, e in ipairs(held) do
        failed(report, e, errors.new("owned", format("still held by %s after waiting %g s: " ..
          "run the job again later", tostring(e.T.application), wait), { step = "each", id = e.id }))
      end
      return
    end
    if #held > 0 then tm.policy.sleep(POLL) end
  end
end

-- tm:each(source, fn, opts): see the header.  `level` is where misuse is
-- reported, counted from this function (and passed on counted from the
-- helper that gets it).

--- What `tm:each` runs (call `tm:each`, documented in mongotx.manager).
-- @syntax report, err = each.run(tm, source, fn, opts, level)
-- @tparam table tm the manager
-- @param source a list or a cursor
-- @func fn the item's ops
-- @tparam table opts as `tm:each`
-- @int level where a misuse is reported
-- @treturn table the report
-- @errors as `tm:each`
-- @usage local report = assert(tm:each(list, fn, { id = "job", key = key_of }))
function _M.run(tm, source, fn, opts, level)
  if type(fn) ~= "function" then
    error("each: fn must be a function, not a " .. type(fn), level)
  end
  local err
  opts, err = options.check(opts, each_options, "each", level)
  if not opts then return nil, err end
  local job = opts.id
  if type(job) ~= "string" then
    error("each: option id (the job's id) must be a string, not " .. type(job), level)
  end
  if opts.key == nil then error("each: option key (a function) is required", level) end
  if job == "" then
    return nil, errors.new("invalid", "each: option id (the job's id) may not be empty",
      { step = "each" })
  end
  opts.batch = opts.batch or 100
  local wait = opts.wait or (tm.policy.lease + tm.policy.stale_after)
  job = job_text(job)
  local next_item = items_of(source, level + 1)
  local report, seen, held = new_report(), {}, {}
  while true do
    local entries
    entries, err = read_batch(report, job, next_item, opts, seen)
    if entries == nil then return nil, err end
    if not entries then break end
    local new, flying = earlier(tm, report, entries)
    if not new then
      err = errors.wrap(flying, "each")
      err.report = report
      return nil, err
    end
    local todo
    todo, err = prepare(tm, report, new, fn, level + 1)
    if not todo then return nil, err end
    for _, e in ipairs(flying) do
      if not settle_earlier(tm, report, e, e.T) then held[#held + 1] = e end
    end
    if #todo > 0 then commit_new(tm, report, todo) end
    report.batches = report.batches + 1
    if opts.progress then opts.progress(report) end
  end
  if #held > 0 then
    await_earlier(tm, report, held, wait)
    if opts.progress then opts.progress(report) end
  end
  if tm.policy.finish == "deferred" then
    local ok
    ok, err = tm:finish()
    if not ok then return nil, err end
  end
  return report
end

return _M
