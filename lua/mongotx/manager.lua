-- The transaction manager: composes the C core's protocol steps
-- (core.steps) under the policies of mongotx.policy.
--
-- States move initial -> pending -> applied -> done, or pending ->
-- canceling -> cancelled; `applied` is the commit point.  An owner holds a
-- transaction by its `epoch` (incremented by every claim); the manager
-- remembers the epochs it holds.  Applies are fenced by document versions
-- read before the claim (see csrc/txn.c): a stalled former owner can never
-- apply an op twice.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local default_policy = require "mongotx.policy"
local stored = require "mongotx.stored"
local batch = require "mongotx.batch"

local steps = core.steps
local canon, id_key = validate.canon, validate.id_key
local ipairs, pairs, type, tostring, setmetatable = ipairs, pairs, type, tostring, setmetatable
local format = string.format

local _M = {}

local Manager = {}
Manager.__index = Manager

local ACTIVE = { "initial", "pending", "applied", "canceling" }
local STATES = { "initial", "pending", "applied", "done", "canceling", "cancelled" }

-- Keep settling a transaction at most this many rounds (each round moves
-- it a state forward or re-reads it), and retry an apply whose document
-- keeps changing under it at most this many times.
local MAX_ROUNDS = 50
local MAX_CONTENTION = 20

-- Set on a document by the remove op of an open transaction (the id of
-- that transaction): no other op applies to it meanwhile (csrc/txn.c).
local REMOVING = "txRemoving"

-- The open transactions whose effect on a document may have raised a
-- value (csrc/txn.c, "Guards"): a floor guard waits for them.
local HELD = "txHeld"

-- Set (to the transaction's id) on the placeholder document a rolled-back
-- takeover leaves where an insert op would have put its document, so that
-- an insert a stalled former owner prepared cannot land (csrc/txn.c,
-- fence).  prune() removes it with the transaction.
local PLACEHOLDER = "txPlaceholder"

local manager_options = {
  collection = true, application = true, marker = true, version_field = true,
  write_concern = true, fencing = true,
}

for k in pairs(default_policy) do manager_options[k] = true end

-- Options are checked by mongotx.options (types raise; values, fencing's
-- and finish's modes and a marker that clashes give nil, err).  fencing:
-- how a creator fences its own applies (see batch.lua); "auto" uses the
-- server's clock where the server can evaluate $$NOW in a filter.
function _M.new(db, opts)
  local why
  opts, why = validate.options(opts, manager_options, "manager", 3)
  if not opts then return nil, why end
  local policy = setmetatable({}, { __index = default_policy })
  for k in pairs(default_policy) do
    if opts[k] ~= nil then policy[k] = opts[k] end
  end
  local self = setmetatable({
    db = db,
    policy = policy,
    collection = opts.collection or "transactions",
    application = opts.application or "mongotx",
    instance = core.ObjectId():value(),
    marker = opts.marker or "pendingTransactions",
    version_field = opts.version_field or "txVersion",
    colls = {},
    held = {},     -- key(id) -> epoch this manager holds
    versions = {}, -- key(id) -> versions read before the claim (steps)
    fencing = opts.fencing or "auto",
    finishing = {}, -- committed transactions the finisher has yet to finish
    clock_offset = nil, -- server clock - monotonic clock, ms (_clock)
    clock_at = nil,     -- monotonic ms when clock_offset was measured
    use_deadline = nil, -- does the server evaluate $$NOW (_deadlines)
  }, Manager)
  self.fields = { marker = self.marker, version = self.version_field, removing = REMOVING,
                  held = HELD, placeholder = PLACEHOLDER }
  self.vctx = { collection = self.collection,
                owned = { "_id", self.marker, self.version_field, REMOVING, HELD,
                          PLACEHOLDER } }
  self.wopts = { write_concern = opts.write_concern or { w = "majority", j = true } }
  self.tx = db.client:collection(db.name, self.collection)
  local ok, err = self.tx:create_index(core.doc("state", 1, "lastModified", 1))
  if not ok then return nil, err end
  return self
end

-- Helpers -----------------------------------------------------------------

-- A transaction id as a table key: equal for ids the server takes for
-- one (1 and 1.0).
local function key(id) return id_key(id) or canon(id) end

local stored_ops, live, has_marker = stored.ops, stored.live, stored.has_marker

function Manager:_event(name, info)
  pcall(self.policy.on_event, name, info)
end

function Manager:_coll(name)
  local c = self.colls[name]
  if not c then
    c = self.db.client:collection(self.db.name, name)
    self.colls[name] = c
  end
  return c
end

-- Calls fn(...) again after a backoff while it fails with a transient
-- error, at most policy.retries times.
function Manager:_retry(step, id, fn, ...)
  local attempt = 0
  while true do
    local res, err = fn(...)
    if res ~= nil then return res end
    if not (err and err.transient) or attempt >= self.policy.retries then
      return nil, errors.wrap(err, step, id)
    end
    attempt = attempt + 1
    self.policy.sleep(self.policy.backoff(attempt))
  end
end

-- The protocol's name of a move to a state (the event a transition
-- reports, as the batched path does).
local MOVE_EVENTS = { applied = "commit", done = "done", canceling = "cancel",
                      cancelled = "cancelled", pending = "renew" }

-- Runs the C step `name` with retries; reports it to on_event under the
-- protocol's name of the step (a transition by the state it moves to).
function Manager:_step(name, id, ...)
  local res, err = self:_retry(name, id, steps[name], ...)
  if res ~= nil then
    local event = name
    if name == "transition" then event = MOVE_EVENTS[select(4, ...)] or name end
    self:_event(event, { id = id, result = res })
  end
  return res, err
end

-- The transaction with this id, or nil.  The id goes into a query, so it
-- is checked like a caller's id: {$gt = ""} must not find another one.
function Manager:_get(id, step, level)
  local kind = type(id)
  if id == nil or kind == "function" or kind == "thread" then
    error(format("%s needs a transaction id, not a %s", step, kind), level + 1)
  end
  local sent, err = validate.check_tid(id)
  if sent == nil then return nil, errors.wrap(err, step, nil) end
  local doc
  doc, err = self.tx:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, step, id) end
  return live(doc)
end

function Manager:get(id)
  return self:_get(id, "get", 2)
end

function Manager:_load(t, step)
  if type(t) ~= "table" or t._id == nil then
    error("expected a transaction (a table with _id)", 3)
  end
  local T, err = self:_get(t._id, step, 3)
  if err then return nil, err end
  if not T then
    return nil, errors.new("state", "no such transaction", { step = step, id = t._id })
  end
  return T
end

function Manager:server_now()
  local reply, err = self.db.client:command("admin", { isMaster = 1 })
  if not reply then return nil, errors.wrap(err, "clock") end
  if core.type(reply.localTime) ~= "date" then
    return nil, errors.new("server", "the server reports no localTime", { step = "clock" })
  end
  return reply.localTime:value()
end

-- The server's clock in ms, estimated from an isMaster a minute old at
-- most: only the length of an owner's window depends on it, not safety
-- (applies and claims both compare deadlines with the server's clock).
local CLOCK_REFRESH_MS = 60000

function Manager:_clock()
  local before = core.monotonic_ms()
  if not self.clock_offset or before - self.clock_at > CLOCK_REFRESH_MS then
    local now, err = self:server_now()
    if not now then return nil, err end
    local after = core.monotonic_ms()
    self.clock_offset, self.clock_at = now - (before + after) / 2, after
    before = after
  end
  return before + self.clock_offset
end

-- Are this manager's applies fenced by a deadline (csrc/txn.c)?  When
-- the server evaluates $$NOW in a query (asked once; an _id lookup keeps
-- the probe cheap) and the lease is not 0: a deadline of now would expire
-- before the first apply.
function Manager:_deadlines()
  if self.use_deadline == nil then
    if self.fencing == "auto" then
      local n = self.tx:count({ _id = "mongotx:probe",
                                ["$expr"] = { ["$lt"] = { "$$NOW", core.Date(0) } } })
      self.use_deadline = n ~= nil
    else
      self.use_deadline = self.fencing == "deadline"
    end
  end
  return self.use_deadline and self.policy.lease > 0
end

-- A deadline this manager's lease from now, or nil when it fences by
-- versions alone.
function Manager:_new_deadline()
  if not self:_deadlines() then return nil end
  local now, err = self:_clock()
  if not now then return nil, err end
  return core.Date(math.floor(now + self.policy.lease * 1000))
end

-- For each transaction of the list and each of its ops: { version = <the
-- document's version>, marked = <the transaction's marker is on it> } (nil
-- version for a missing document); one find per collection for them all.
function Manager:_versions_many(list)
  local by_coll, found = {}, {}
  for _, T in ipairs(list) do
    for _, op in ipairs(T.ops) do
      local ids = by_coll[op.collection] or {}
      ids[#ids + 1] = op.id
      by_coll[op.collection] = ids
    end
  end
  for name, ids in pairs(by_coll) do
    local docs, err = self:_coll(name):find_all({ _id = { ["$in"] = ids } },
      { projection = { [self.marker] = 1, [self.version_field] = 1 } })
    if not docs then return nil, errors.wrap(err, "versions", #list == 1 and list[1]._id or nil) end
    for _, doc in ipairs(docs) do found[name .. "\0" .. key(doc._id)] = doc end
  end
  local out = {}
  for t, T in ipairs(list) do
    local vs = {}
    for i, op in ipairs(T.ops) do
      local doc = found[op.collection .. "\0" .. key(op.id)]
      vs[i] = { marked = false }
      if doc then
        vs[i].version = doc[self.version_field]
        vs[i].marked = has_marker(doc, self.marker, T._id)
      end
    end
    out[t] = vs
  end
  return out
end

function Manager:_versions(T)
  local all, err = self:_versions_many({ T })
  if not all then return nil, err end
  return all[1]
end

-- Claims T as it was read: same state and epoch.  The epoch changes with
-- every claim, so it identifies the owner seen better than lastModified
-- could (mongo-java-server keeps $currentDate finer than the millisecond
-- it returns, so an equality match on it never succeeds).  `set` adds
-- fields (state for initial -> pending).  Returns the claimed document, or
-- false when somebody else moved T first.
--
-- A transaction its creator runs at once carries a `deadline` (batch.lua):
-- the creator's applies match only before it by the server's clock, and
-- no one may claim the transaction until it passed.  `now` is the server's
-- time read before this call (read here when not given): the claim then
-- runs later still.
function Manager:_claim(T, set, now)
  set = set or {}
  set.application, set.instance, set.lease = self.application, self.instance, self.policy.lease
  if T.state == "pending" or set.state == "pending" then
    -- this owner's applies are fenced by its own deadline (csrc/txn.c)
    local deadline, err = self:_new_deadline()
    if err then return nil, err end
    set.deadline = deadline
  end
  local expect = { state = T.state, epoch = T.epoch or 0 }
  if T.deadline ~= nil and T.state == "pending" then
    if not now then
      local err
      now, err = self:server_now()
      if not now then return nil, err end
    end
    expect.deadline = { ["$lt"] = core.Date(now) }
  end
  local doc, err = self:_step("claim", T._id, self.tx, T._id, expect, set, self.wopts)
  if doc == nil then return nil, err end
  if doc then self.held[key(T._id)] = doc.epoch end
  return live(doc)
end

-- This manager as the ownership policy sees it.
function Manager:_me()
  return { application = self.application, instance = self.instance,
           stale_after = self.policy.stale_after, lease = self.policy.lease }
end

function Manager:_holds(T)
  return T.state == "pending" and self.held[key(T._id)] == T.epoch
end

-- Versions read while this manager holds T: read, then check T is still
-- held, so any later owner's writes come after the read.
function Manager:_confirmed_versions(T)
  local versions, err = self:_versions(T)
  if not versions then return nil, err end
  local now
  now, err = self:get(T._id)
  if err then return nil, err end
  if not now or not self:_holds(now) then return false, now end
  return versions
end

local function op_name(op)
  return format("%s %s of %s", op.kind, tostring(op.id), op.collection)
end

local failure_text = {
  missing = "the document does not exist",
  guard = "its where condition is false",
  conflict = "another document has its _id",
  contention = "the document kept changing",
  removing = "another transaction is removing the document",
  busy = "another open transaction holds the document its guard reads",
}

local function op_failure(T, i, reason)
  return errors.new(reason, format("op %d (%s): %s", i, op_name(T.ops[i]),
    failure_text[reason] or reason), { step = "apply", id = T._id, op = i })
end

-- Phases ------------------------------------------------------------------

-- Applies op i, fenced by v.version (false: none read) and by v.deadline
-- (this owner's, T's by default where deadlines fence); returns true, or
-- false and why it cannot, or nil, err.
function Manager:_apply_one(T, i, v)
  local op = T.ops[i]
  local coll = self:_coll(op.collection)
  if v.deadline == nil and self:_deadlines() then v.deadline = T.deadline end
  for _ = 1, MAX_CONTENTION do
    local res, err = self:_step("apply", T._id, coll, T._id, op, v.version, self.fields,
      self.wopts, v.deadline)
    if not res then return nil, err end
    if res.applied then return true end
    -- Why not? Read the document, then (if its version moved) check
    -- that T is still ours before trying with the version just read.
    local doc
    doc, err = coll:find_one({ _id = op.id })
    if err then return nil, errors.wrap(err, "apply", T._id) end
    if has_marker(doc, self.marker, T._id) then return true end
    if doc and doc[REMOVING] ~= nil then return false, "removing" end
    if op.kind == "insert" then
      if doc then return false, "conflict" end
    elseif not doc then
      return false, "missing"
    else
      -- a guard reads no effect that may still be undone (csrc/txn.c):
      -- committed holders are finished first, open ones make it wait
      local finished = 0
      if op.where then
        local open
        finished, open = self:_release(op, doc, T._id)
        if finished == nil then return nil, open end
        if finished == 0 and open then return false, "busy" end
      end
      if finished == 0 then
        if op.where then
          local filter = { _id = op.id }
          for k, x in pairs(op.where) do filter[k] = x end
          local n
          n, err = coll:count(filter)
          if not n then return nil, errors.wrap(err, "apply", T._id) end
          if n == 0 then return false, "guard" end
        end
        local ok
        ok, err = self:_refence(T, i, v, doc)
        if not ok then return nil, err end
      end
      -- else the finished holders moved the document: try again
    end
  end
  return false, "contention"
end

-- The document of op i moved under T's apply: if T is still this
-- manager's, fence the next try by the version just read and by a renewed
-- deadline (it may have passed: an owner past its deadline must not apply,
-- whoever else might be driving T).  Returns true, or nil, err (`fenced`
-- when another owner took T over).
function Manager:_refence(T, i, v, doc)
  local now, err = self:get(T._id)
  if err then return nil, err end
  local fenced = errors.new("fenced", "another owner took the transaction over",
    { step = "apply", id = T._id, op = i })
  if not now or not self:_holds(now) then return nil, fenced end
  v.version = doc[self.version_field]
  if v.deadline then
    local renewed
    renewed, err = self:_renew(now)
    if renewed == nil then return nil, err end
    if not renewed then return nil, fenced end
    v.deadline = renewed
  end
  return true
end

-- Moves T's deadline (and lastModified) a lease on while this manager
-- still holds it, so that an owner working past its deadline still fences
-- every apply by the server's clock.  Returns the new deadline, false when
-- T was taken over meanwhile, or nil, err.
function Manager:_renew(T)
  local deadline, err = self:_new_deadline()
  if not deadline then return nil, err end
  local moved
  moved, err = self:_step("transition", T._id, self.tx, T._id, "pending", "pending", T.epoch,
    { deadline = deadline }, self.wopts)
  if moved == nil then return nil, err end
  return moved and deadline
end

-- The document of op carries the markers of other transactions.  Those
-- that have committed (applied or done) are final: this finishes them on
-- the document (any manager may help a committed transaction along), so
-- that the guard reads their effect.  The open ones a guard may not read
-- past: all of them for most guards, for a floor guard those in the
-- `held` array (their effect may have raised a value; see csrc/txn.c).
-- Returns how many were finished and whether an open one that matters is
-- left, or nil, err.
function Manager:_release(op, doc, tid)
  local coll, k = self:_coll(op.collection), id_key(op.id)
  local matters = {}
  for _, x in ipairs(stored.holders(doc, op.floor and HELD or self.marker, tid)) do
    matters[key(x)] = true
  end
  local finished, open = 0, false
  for _, holder in ipairs(stored.holders(doc, self.marker, tid)) do
    local H, err = self:get(holder)
    if err and err.code ~= "invalid" then return nil, err end
    local hop
    if H and (H.state == "applied" or H.state == "done")
        and not validate.malformed(H, self.vctx) then
      for _, o in ipairs(H.ops) do
        if o.collection == op.collection and id_key(o.id) == k then hop = o end
      end
    end
    if hop then
      local res
      res, err = self:_step("finish", H._id, coll, H._id, hop, self.fields, self.wopts)
      if not res then return nil, err end
      if res.finished then finished = finished + 1 end
    elseif matters[key(holder)] then
      open = true
    end
  end
  return finished, open
end

-- pending (held) -> applied, or -> canceling when an op cannot apply.
-- Returns the transaction's next document and, after a cancel, the error
-- that explains it.
function Manager:_apply_all(T, versions)
  for i in ipairs(T.ops) do
    local v = versions[i]
    if not v.marked then
      local tries = 0
      while true do
        local ok, why = self:_apply_one(T, i, v)
        if ok then break end
        if ok == nil then
          if why.code == "fenced" then return self:get(T._id) end
          return nil, why
        end
        local decision = self.policy.on_op_failure(T, i, why)
        tries = tries + 1
        if decision == "retry" and tries <= self.policy.retries then
          self.policy.sleep(self.policy.backoff(tries))
        elseif decision == "fail" then
          return nil, op_failure(T, i, why)
        else
          local failure = op_failure(T, i, why)
          local moved, err = self:_cancel(T, failure.message)
          if not moved then return nil, err end
          return moved, nil, failure
        end
      end
    end
  end
  return self:_move(T, "pending", "applied", T.epoch)
end

-- Moves T from state `from` (at `epoch`, when given) to `to`, setting
-- `set` too; returns T as it now is: as moved (the step returns it), or
-- as read when somebody else moved it first.
function Manager:_move(T, from, to, epoch, set)
  local moved, err = self:_step("transition", T._id, self.tx, T._id, from, to, epoch, set,
    self.wopts)
  if moved == nil then return nil, err end
  if moved then return live(moved) end
  local now
  now, err = self:get(T._id)
  if now then return now end
  return nil, err or errors.new("state", "no such transaction", { step = to, id = T._id })
end

-- pending (held) -> canceling, recording why.
function Manager:_cancel(T, reason)
  return self:_move(T, "pending", "canceling", T.epoch, { reason = reason })
end

-- applied -> done: pull every marker (delete removed documents), then done.
function Manager:_finish(T)
  for _, op in ipairs(T.ops) do
    local res, err = self:_step("finish", T._id, self:_coll(op.collection), T._id, op,
      self.fields, self.wopts)
    if not res then return nil, err end
  end
  return self:_move(T, "applied", "done")
end

-- Undoes op i of a canceling T where it was applied; after a takeover
-- (epoch > 1) fences the document too.  Returns undo's result, or nil,
-- err.
function Manager:_undo_op(T, i)
  local op, coll = T.ops[i], self:_coll(T.ops[i].collection)
  local undone
  for _ = 1, 3 do
    local res, err = self:_step("undo", T._id, coll, T._id, op, self.fields, self.wopts)
    if not res then return nil, err end
    undone = undone or res
    -- an insert a former owner prepared would land after this undo
    -- deleted the document: fence it too (a placeholder takes the _id)
    if (T.epoch or 0) <= 1 or res.undone and op.kind ~= "insert" then break end
    res, err = self:_step("fence", T._id, coll, T._id, op, self.fields, self.wopts)
    if not res then return nil, err end
    if res.fenced then break end
    -- the marker appeared between undo and fence: undo again
  end
  return undone
end

-- canceling -> cancelled: undo the applied ops in reverse order.  After a
-- takeover (epoch > 1) a former owner may still hold a prepared apply, so
-- documents not applied are fenced (their version moved) as well.
function Manager:_unwind(T)
  for i = #T.ops, 1, -1 do
    local _, err = self:_undo_op(T, i)
    if err then return nil, err end
  end
  return self:_move(T, "canceling", "cancelled")
end

local function cancelled_error(T)
  return errors.new("cancelled", "the transaction was cancelled: " ..
    tostring(T.reason or "no reason recorded"), { id = T._id, reason = T.reason })
end

-- Drives T to done or cancelled from whatever state it is in.  `versions`
-- are those read before this manager claimed T, when it just did.
function Manager:_drive(T, versions)
  local failure, err
  for _ = 1, MAX_ROUNDS do
    local state = T.state
    if state == "done" or state == "cancelled" then
      self.held[key(T._id)] = nil -- nothing left to fence
      if state == "done" then return T end
      return nil, failure or cancelled_error(T)
    end
    if state == "initial" then
      versions, err = self:_versions(T)
      if not versions then return nil, err end
      local claimed
      claimed, err = self:_claim(T, { state = "pending" })
      if claimed == nil then return nil, err end
      if not claimed then versions = nil end
      T = claimed or self:get(T._id)
    elseif state == "pending" then
      if not self:_holds(T) then
        return nil, errors.new("owned", format("held by %s; recover() takes it " ..
          "over once its lease expired", tostring(T.application)), { id = T._id })
      end
      if not versions then
        local now
        versions, now = self:_confirmed_versions(T)
        if versions == nil then return nil, now end
        if not versions then T, versions = now, nil end
      end
      if versions then
        local f
        T, err, f = self:_apply_all(T, versions)
        failure = failure or f
        versions = nil
      end
    elseif state == "applied" then
      T, err = self:_finish(T)
    elseif state == "canceling" then
      T, err = self:_unwind(T)
    else
      return nil, errors.new("state", "unknown state " .. tostring(state), { id = T._id })
    end
    if not T then return nil, err end
  end
  return nil, errors.new("state", "the transaction did not settle", { id = T._id })
end

-- The public API ------------------------------------------------------------

local begin_options = { id = true, meta = true }

-- Checks what begin and run take: a batch spec { ops, id, meta, extra }
-- (batch.lua), or nil, err.  Wrong argument types raise at `level`.
function Manager:_spec(ops, opts, extra, what, level)
  local err
  opts, err = validate.options(opts, begin_options, what, level + 1)
  if not opts then return nil, err end
  local norm
  norm, err = validate.ops(ops, self.vctx)
  if not norm then return nil, err end
  if opts.meta ~= nil then
    local ok
    ok, err = options.meta(opts.meta, norm, what)
    if not ok then return nil, err end
  end
  local id = opts.id
  if id ~= nil then
    local why
    id, why = validate.check_tid(id)
    if id == nil then return nil, why end
  end
  return { ops = norm, id = id, meta = opts.meta, extra = extra }
end

-- Creates the transaction (state initial) after checking every op.  With
-- opts.id, repeating begin is safe: the same ops return the existing
-- transaction, other ops are an `idempotency` error.
function Manager:begin(ops, opts, extra)
  local spec, err = self:_spec(ops, opts, extra, "begin", 2)
  if not spec then return nil, err end
  local id = spec.id
  if id == nil then id = core.ObjectId() end
  local doc = { _id = id, state = "initial", ops = stored_ops(spec.ops), epoch = 0,
                attempts = 0, meta = spec.meta }
  for k, v in pairs(extra or {}) do doc[k] = v end
  local res
  res, err = self:_step("create", id, self.tx, doc, self.wopts)
  if not res then return nil, err end
  if res.created then
    doc.ops = spec.ops
    return doc
  end
  local existing
  existing, err = self:get(id)
  if err then return nil, err end
  if existing and canon(existing.ops) == canon(spec.ops) then return existing end
  return nil, errors.new("idempotency", "this id was used for other ops",
    { step = "begin", id = id })
end

-- Drives the transaction to done; nil, err when it ended cancelled (err
-- says which op and why) or could not be driven.
function Manager:commit(t)
  local T, err = self:_load(t, "commit")
  if not T then return nil, err end
  return self:_drive(T, nil)
end

-- Runs specs as one batch; the i-th result, or false and its error.
function Manager:_run_batch(specs, errs)
  local todo, where = {}, {}
  for i = 1, #errs do
    if specs[i] then
      todo[#todo + 1], where[#todo + 1] = specs[i], i
    end
  end
  local results = {}
  for i = 1, #errs do results[i] = false end
  if #todo > 0 then
    local res, bad = batch.run(self, todo)
    for k, i in ipairs(where) do results[i], errs[i] = res[k], bad[k] end
  end
  return results, errs
end

-- begin + commit in one go, the fast way (batch.lua): the transaction is
-- created pending and owned.  Returns it at `done` (or at `applied` with
-- policy.finish = "deferred"), or nil, err.
function Manager:run(ops, opts, extra)
  local spec, err = self:_spec(ops, opts, extra, "run", 2)
  if not spec then return nil, err end
  local results, errs = self:_run_batch({ spec }, { false })
  if results[1] then return results[1] end
  return nil, errs[1]
end

local transfer_options = { field = true, min = true, id = true, meta = true }

-- The spec of a transfer (raises at `level` for wrong argument types).
function Manager:_transfer_spec(collection, from, to, amount, opts, level)
  local ok, err = validate.amount(amount)
  if not ok then return nil, err end
  local field = opts.field or "balance"
  if type(field) ~= "string" then error("field must be a string", level + 1) end
  local where
  if opts.min ~= nil then
    -- any finite floor (an overdraft limit may be negative), and a bound
    -- min + amount that is still exact
    ok, err = validate.bound(opts.min, "min")
    if ok then ok, err = validate.bound(opts.min + amount, "min + amount") end
    if not ok then return nil, err end
    where = { [field] = { ["$gte"] = opts.min + amount } }
  end
  return self:_spec({
    { collection = collection, id = from, update = { ["$inc"] = { [field] = -amount } },
      where = where },
    { collection = collection, id = to, update = { ["$inc"] = { [field] = amount } } },
  }, { id = opts.id, meta = opts.meta }, { source = from, destination = to, value = amount },
    "transfer", level + 1)
end

function Manager:transfer(collection, from, to, amount, opts)
  local spec, err
  opts, err = validate.options(opts, transfer_options, "transfer", 2)
  if not opts then return nil, err end
  spec, err = self:_transfer_spec(collection, from, to, amount, opts, 2)
  if not spec then return nil, err end
  local results, errs = self:_run_batch({ spec }, { false })
  if results[1] then return results[1] end
  return nil, errs[1]
end

-- A batch of specs checked one by one: a bad one gets its error and is
-- left out, nothing written for it; so does a repeated id.
local function batch_specs(list, what, check)
  if type(list) ~= "table" then error(what .. " takes a list", 3) end
  local specs, errs, seen = {}, {}, {}
  for i = 1, #list do
    if type(list[i]) ~= "table" then error(format("%s: item %d is not a table", what, i), 3) end
    local spec, err = check(list[i], i)
    if spec and spec.id ~= nil then
      local k = key(spec.id)
      if seen[k] then
        spec, err = nil, errors.new("invalid", format("item %d repeats the id of item %d", i,
          seen[k]), { step = what, id = spec.id })
      end
      seen[k] = seen[k] or i
    end
    specs[i], errs[i] = spec or false, err or false
  end
  return specs, errs
end

local many_options = { ops = true, id = true, meta = true }

-- Runs many transactions with one round trip per protocol step for the
-- whole batch.  list[i] is an ops list or { ops =, id =, meta = }.
-- Returns results, errs: results[i] the transaction or false, errs[i]
-- why not (false when it ran); an op that cannot apply cancels only its
-- own transaction.
function Manager:commit_many(list)
  return self:_run_batch(batch_specs(list, "commit_many", function(item, i)
    if item.ops == nil then return self:_spec(item, nil, nil, "commit_many", 4) end
    local ok, err = validate.options(item, many_options, "commit_many item " .. i, 5)
    if not ok then return nil, err end
    return self:_spec(item.ops, { id = item.id, meta = item.meta }, nil, "commit_many", 4)
  end))
end

local transfer_many_options = { collection = true, from = true, to = true, amount = true }
for k in pairs(transfer_options) do transfer_many_options[k] = true end

-- tm:transfer for many: list[i] = { collection =, from =, to =, amount =
-- [, field =, min =, id =, meta =] }; returns results, errs as commit_many.
function Manager:transfer_many(list)
  return self:_run_batch(batch_specs(list, "transfer_many", function(item, i)
    local ok, err = validate.options(item, transfer_many_options, "transfer_many item " .. i, 5)
    if not ok then return nil, err end
    return self:_transfer_spec(item.collection, item.from, item.to, item.amount, item, 4)
  end))
end

-- Finishes the transactions committed with policy.finish = "deferred"
-- (it runs by itself every policy.finish_batch commits): pulls their
-- markers and moves them to done, one round trip per collection and one
-- for the states.  Returns how many, or nil, err (they stay `applied`,
-- and recovery finishes them).
function Manager:finish()
  local list = self.finishing
  self.finishing = {}
  return batch.finish(self, list)
end

-- pending -> canceling -> cancelled, undoing what was applied.  A
-- transaction never started ends cancelled at once.
function Manager:rollback(t, reason)
  local T, err = self:_load(t, "rollback")
  if not T then return nil, err end
  if reason ~= nil and type(reason) ~= "string" then error("reason must be a string", 2) end
  if reason ~= nil and #reason > options.MAX_REASON then
    return nil, errors.new("invalid", format("reason takes %d bytes, more than the %d that " ..
      "fit in the transaction document", #reason, options.MAX_REASON),
      { step = "rollback", id = T._id })
  end
  reason = reason or "rolled back"
  if T.state == "initial" then
    T, err = self:_move(T, "initial", "cancelled", T.epoch, { reason = reason })
    if not T then return nil, err end
  elseif T.state == "pending" then
    if not self:_holds(T) then
      local now
      now, err = self:server_now()
      if not now then return nil, err end
      local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
      if not self.policy.may_recover(T, age, self:_me()) then
        return nil, errors.new("owned", format("held by %s until its lease expires",
          tostring(T.application)), { step = "rollback", id = T._id })
      end
      local claimed
      claimed, err = self:_claim(T, nil, now)
      if claimed == nil then return nil, err end
      if not claimed then return self:rollback(t, reason) end
      T = claimed
    end
    T, err = self:_cancel(T, reason)
    if not T then return nil, err end
  end
  if T.state == "applied" or T.state == "done" then
    return nil, errors.new("state", "the transaction is committed: compensate it instead",
      { step = "rollback", id = T._id })
  end
  local final
  final, err = self:_drive(T, nil)
  if final then return nil, errors.new("state", "the transaction committed meanwhile",
    { step = "rollback", id = T._id }) end
  if err.code == "cancelled" then return true end
  return nil, err
end

-- The id of the transaction compensating the one with this id: derived
-- from it, so it is created at most once however often (and from
-- wherever) compensate is called.  A string, not a document: it becomes a
-- marker, and FerretDB cannot $pull a document value.
function _M.compensation_id(id)
  return "compensates:" .. key(id)
end

-- A new transaction with the inverse ops of a committed one, linked by
-- `compensates`.
function Manager:compensate(t)
  local T, err = self:_load(t, "compensate")
  if not T then return nil, err end
  if T.state == "applied" then
    T, err = self:_drive(T, nil)
    if not T then return nil, err end
  end
  if T.state ~= "done" then
    return nil, errors.new("state", "only a committed transaction can be compensated",
      { step = "compensate", id = T._id })
  end
  local ops, why = self.policy.compensation(T)
  if not ops then
    return nil, errors.new("invalid", why, { step = "compensate", id = T._id })
  end
  local C
  C, err = self:begin(ops, { id = _M.compensation_id(T._id) }, { compensates = T._id })
  if not C then return nil, err end
  self:_event("compensate", { id = T._id, by = C._id })
  return self:commit(C)
end

-- Recovery ----------------------------------------------------------------

function Manager:_park(T, reason)
  local res, err = self.tx:update_one({ _id = T._id },
    { ["$set"] = { parked = true, reason = reason } }, self.wopts)
  if not res then return nil, errors.wrap(err, "park", T._id) end
  self:_event("park", { id = T._id, reason = reason })
  return "parked"
end

-- Recovers one stale transaction; returns what happened: "done",
-- "cancelled", "skipped" or "parked", or nil, err.
function Manager:_recover_one(T, now, me)
  if (T.attempts or 0) >= self.policy.max_attempts then
    return self:_park(T, T.reason or "recovery failed too many times")
  end
  local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
  if not self.policy.may_recover(T, age, me) then return "skipped" end
  local versions, err
  if T.state == "initial" and self.policy.stale_initial(T) == "expire" then
    local moved
    moved, err = self:_step("transition", T._id, self.tx, T._id, "initial", "cancelled",
      T.epoch, { reason = "expired" }, self.wopts)
    if moved == nil then return nil, err end
    return moved and "cancelled" or "skipped"
  end
  if T.state == "initial" or T.state == "pending" then
    versions, err = self:_versions(T)
    if not versions then return nil, err end
  end
  local was = T.state
  local claimed
  claimed, err = self:_claim(T, was == "initial" and { state = "pending" } or nil, now)
  if claimed == nil then return nil, err end
  if not claimed then return "skipped" end
  T = claimed
  -- a stale initial one was never started: stale_initial decided it
  if was == "pending" and self.policy.stale_pending(T) == "back" then
    T, err = self:_cancel(T, "rolled back by recovery")
    if not T then return nil, err end
    versions = nil
  end
  local final
  final, err = self:_drive(T, versions)
  if final then return "done" end
  if err.code == "cancelled" or err.code == "missing" or err.code == "guard"
      or err.code == "conflict" then
    local again = self:get(T._id)
    if again and again.state == "cancelled" then return "cancelled" end
  end
  return nil, err
end

-- Up to `limit` well-formed active transactions that are not parked,
-- oldest first, read before recovery writes anything.  A malformed one
-- (validate.malformed) is counted in report.malformed and listed in
-- report.errors (the first `limit` of them), never written: it is evidence
-- for an operator.  Malformed ones do not count against the limit, so
-- however many pile up they cannot starve the well-formed ones behind
-- them; they only cost a read per pass until someone removes them.
function Manager:_stale_list(limit, report)
  local cursor = self.tx:find({
    state = { ["$in"] = ACTIVE },
    parked = { ["$ne"] = true },
  }, { sort = { lastModified = 1 } })
  local list, listed = {}, 0
  while #list < limit do
    local T, err = cursor:next()
    if not T then
      cursor:close()
      if err then return nil, errors.wrap(err, "recover") end
      return list
    end
    local why = validate.malformed(T, self.vctx)
    if not why then
      list[#list + 1] = T
    else
      report.malformed = report.malformed + 1
      if listed < limit then
        listed = listed + 1
        report.errors[#report.errors + 1] = { id = T._id, error = errors.new("malformed",
          "malformed transaction, left as it is: " .. why, { step = "recover", id = T._id }) }
      end
    end
  end
  cursor:close()
  return list
end

-- Finds stale transactions and drives each to done or cancelled under the
-- policies.  Returns a report: { examined, done, cancelled, skipped,
-- parked, failed, malformed, errors = { {id, error}, ... } }.
function Manager:recover(opts)
  local now, err
  opts, err = validate.options(opts, { limit = true }, "recover", 2)
  if not opts then return nil, err end
  now, err = self:server_now()
  if not now then return nil, err end
  local me = self:_me()
  local report = { examined = 0, done = 0, cancelled = 0, skipped = 0, parked = 0,
                   failed = 0, malformed = 0, errors = {} }
  -- Oldest first; whether each one is stale enough is the policy's call
  -- (a holder may have declared a shorter lease than this manager's).
  local list
  list, err = self:_stale_list(opts.limit or 1000, report)
  if not list then return nil, err end
  for _, T in ipairs(list) do
    report.examined = report.examined + 1
    local ok, outcome, failure = pcall(function()
      return self:_recover_one(live(T), now, me)
    end)
    if ok and outcome then
      report[outcome] = report[outcome] + 1
    else
      local e = ok and failure or errors.new("policy", tostring(outcome), { id = T._id })
      report.failed = report.failed + 1
      report.errors[#report.errors + 1] = { id = T._id, error = e }
      -- count the failure, so that a transaction that keeps failing is
      -- parked (with this reason) instead of blocking every pass
      self.tx:update_one({ _id = T._id }, { ["$inc"] = { attempts = 1 },
        ["$set"] = { reason = tostring(e) } }, self.wopts)
    end
  end
  self:_event("recover", report)
  return report
end

-- Deletes finished transactions older than the retention period (or
-- opts.older_than seconds); returns how many.
function Manager:prune(opts)
  local now, err
  opts, err = validate.options(opts, { older_than = true }, "prune", 2)
  if not opts then return nil, err end
  now, err = self:server_now()
  if not now then return nil, err end
  local age = opts.older_than or self.policy.retention
  local before = core.Date(math.floor(now - age * 1000))
  local ok
  ok, err = self:_prune_placeholders(before)
  if not ok then return nil, err end
  local res
  res, err = self.tx:delete_many({
    state = { ["$in"] = { "done", "cancelled" } },
    lastModified = { ["$lt"] = before },
  }, self.wopts)
  if not res then return nil, errors.wrap(err, "prune") end
  return res.deleted
end

-- Deletes the placeholders (csrc/txn.c, fence) of the cancelled
-- transactions with insert ops that prune is about to delete: a former
-- owner stalled for longer than the retention period is the risk this
-- takes.  A placeholder that mongotx has written to since (it carries a
-- marker field) is left alone, and so are malformed transactions.
function Manager:_prune_placeholders(before)
  local list, err = self.tx:find_all({ state = "cancelled", lastModified = { ["$lt"] = before },
    ["ops.kind"] = "insert" })
  if not list then return nil, errors.wrap(err, "prune") end
  for _, T in ipairs(list) do
    for _, op in ipairs(validate.malformed(T, self.vctx) and {} or T.ops) do
      if op.kind == "insert" then
        local res
        res, err = self:_coll(op.collection):delete_one({ _id = op.id, [PLACEHOLDER] = T._id,
          [self.marker] = { ["$exists"] = false } }, self.wopts)
        if not res then return nil, errors.wrap(err, "prune", T._id) end
      end
    end
  end
  return true
end

function Manager:find(filter, opts)
  local list, err = self.tx:find_all(filter or {}, opts)
  if not list then return nil, errors.wrap(err, "find") end
  for _, T in ipairs(list) do live(T) end
  return list
end

-- Counts by state, plus `parked`.
function Manager:stats()
  local out = {}
  for _, state in ipairs(STATES) do
    local n, err = self.tx:count({ state = state })
    if not n then return nil, errors.wrap(err, "stats") end
    out[state] = n
  end
  local n, err = self.tx:count({ parked = true })
  if not n then return nil, errors.wrap(err, "stats") end
  out.parked = n
  return out
end

-- One protocol step at a time, as in the tutorial:
--   tm:step("claim", t)        initial -> pending (reads versions first)
--   tm:step("apply", t, i)     op i, with the versions read at the claim
--   tm:step("commit", t)       pending -> applied
--   tm:step("finish", t, i)    pull op i's marker
--   tm:step("done", t)         applied -> done
--   tm:step("cancel", t)       pending -> canceling
--   tm:step("undo", t, i)      undo op i if it was applied
--   tm:step("cancelled", t)    canceling -> cancelled
-- Each returns the step's result table (or false / nil, err).  Steps obey
-- the rules the other calls do: claim follows the ownership policy (a
-- held transaction is claimed again only once its lease expired);
-- apply, commit and cancel need the transaction held by this manager;
-- finish and done need it committed, undo and cancelled canceling; commit
-- needs every op applied, done and cancelled every marker gone.  So a
-- step out of order is refused (`state`, `owned`), and repeating a step
-- that succeeded changes nothing.
local STEP_STATES = {
  apply = "pending", commit = "pending", cancel = "pending",
  finish = "applied", done = "applied", undo = "canceling", cancelled = "canceling",
}
-- The states a step leads to: repeating it there is a no-op, not an error.
local STEP_AFTER = {
  commit = { applied = true, done = true }, cancel = { canceling = true, cancelled = true },
  finish = { done = true }, done = { done = true },
  undo = { cancelled = true }, cancelled = { cancelled = true },
}
local TRANSITIONS = {
  commit = { "pending", "applied" }, done = { "applied", "done" },
  cancel = { "pending", "canceling" }, cancelled = { "canceling", "cancelled" },
}

function Manager:step(name, t, i)
  local want = STEP_STATES[name]
  if not want and name ~= "claim" then error("unknown step " .. tostring(name), 2) end
  local T, err = self:_load(t, name)
  if not T then return nil, err end
  local function refuse(code, message)
    return nil, errors.new(code, message, { step = name, id = T._id })
  end
  local k = key(T._id)
  if name == "claim" then return self:_step_claim(T, refuse) end
  local op
  if name == "apply" or name == "finish" or name == "undo" then
    op = T.ops[i]
    if not op then error("no op " .. tostring(i), 2) end
  end
  local again = T.state ~= want and STEP_AFTER[name] and STEP_AFTER[name][T.state]
  if again and TRANSITIONS[name] then return { moved = false } end
  if T.state ~= want and not again then
    return refuse("state", format("the transaction is %s, not %s", tostring(T.state), want))
  end
  if want == "pending" and not self:_holds(T) then
    return refuse("owned", "this manager does not hold the transaction: claim it first")
  end
  if name == "apply" then
    local versions = self.versions[k]
    if not versions then
      versions, err = self:_confirmed_versions(T)
      if versions == nil then return nil, err end
      if not versions then return refuse("owned", "not held by this manager") end
      self.versions[k] = versions
    end
    local ok, why = self:_apply_one(T, i, versions[i])
    if ok == nil then return nil, why end
    if not ok then return nil, op_failure(T, i, why) end
    return { applied = true }
  elseif name == "finish" then
    return self:_step("finish", T._id, self:_coll(op.collection), T._id, op, self.fields,
      self.wopts)
  elseif name == "undo" then
    return self:_undo_op(T, i)
  end
  -- commit needs every op applied; done and cancelled every marker gone
  if name ~= "cancel" then
    local versions
    versions, err = self:_versions(T)
    if not versions then return nil, err end
    for j, v in ipairs(versions) do
      if (name == "commit") ~= v.marked then
        return refuse("state", format("op %d is %s", j, name == "commit" and "not applied"
          or (name == "done" and "not finished" or "not undone")))
      end
    end
  end
  local m = TRANSITIONS[name]
  if name == "done" or name == "cancelled" then self.versions[k] = nil end
  local moved
  moved, err = self:_step("transition", T._id, self.tx, T._id, m[1], m[2],
    want == "pending" and T.epoch or nil, nil, self.wopts)
  if moved == nil then return nil, err end
  return { moved = moved and true or false }
end

-- step("claim"): an initial transaction is anyone's; an active one held
-- by this manager is returned as it is (claiming again would change its
-- epoch); one held by another needs the ownership policy's leave.
function Manager:_step_claim(T, refuse)
  if T.state == "done" or T.state == "cancelled" then
    return refuse("state", "the transaction is " .. T.state .. ": there is nothing to claim")
  end
  if self.held[key(T._id)] == T.epoch and T.epoch ~= nil then return T end
  local now, err
  if T.state ~= "initial" then
    now, err = self:server_now()
    if not now then return nil, err end
    local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
    if not self.policy.may_recover(T, age, self:_me()) then
      return refuse("owned", format("held by %s until its lease expires",
        tostring(T.application)))
    end
  end
  local versions
  if T.state == "initial" or T.state == "pending" then
    versions, err = self:_versions(T)
    if not versions then return nil, err end
  end
  local claimed
  claimed, err = self:_claim(T, T.state == "initial" and { state = "pending" } or nil, now)
  if claimed and versions then self.versions[key(T._id)] = versions end
  return claimed, err
end

return _M
