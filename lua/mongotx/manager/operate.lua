-- mongotx.manager.operate: what is done to one transaction from outside
-- its run: rollback (before commit), compensate (after), one protocol
-- step (step), and what an operator runs on the transactions collection:
-- prune, unpark, inspect.
-- Methods of the Manager class (mongotx.manager adds `methods` to it), and
-- compensation_id.

--- The manager's operator methods.
-- @submodule mongotx.manager

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local stored = require "mongotx.stored"
local counts = require "mongotx.manager.counts"
local engine = require "mongotx.engine"
local holds = require "mongotx.holds"
local stepwise = require "mongotx.stepwise"

local key = validate.tid_key
local ipairs, pairs, type, tostring = ipairs, pairs, type, tostring
local format = string.format

local ACTIVE = counts.ACTIVE

-- A misuse is reported at the caller of the public method (mongotx.manager).
local CALLER = 2

local _M = {}

--- @type Manager
local Manager = {}
_M.methods = Manager

-- pending -> canceling -> cancelled, undoing what was applied.  A
-- transaction never started ends cancelled at once.

--- Cancels a transaction that has not committed, undoing its applied ops.
-- @syntax ok, err = tm:rollback(t [, reason])
-- @tparam table t the transaction
-- @string[opt="rolled back"] reason stored on the transaction
-- @treturn boolean true
-- @errors `state` (committed: compensate it instead), `owned`, `invalid` (reason too long), database errors
-- @usage assert(tm:rollback(t, "customer cancelled"))
function Manager:rollback(t, reason)
  if reason ~= nil and type(reason) ~= "string" then error("reason must be a string", CALLER) end
  local T, err = self:_load(t, "rollback")
  if not T then return nil, err end
  if reason ~= nil and core.check_value(reason) then
    return nil, errors.new("invalid", "reason: " .. core.check_value(reason),
      { step = "rollback", id = T._id })
  end
  if reason ~= nil and #reason > options.MAX_REASON then
    return nil, errors.new("invalid", format("reason takes %d bytes, more than the %d that " ..
      "fit in the transaction document", #reason, options.MAX_REASON),
      { step = "rollback", id = T._id })
  end
  reason = reason or "rolled back"
  if type(T.hold) == "table" then
    return nil, errors.new("invalid", "a hold is voided with void, not rolled back",
      { step = "rollback", id = T._id })
  end
  if T.state == "initial" then
    T, err = self.engine:move(T, "cancelled", "initial", T.epoch, reason, "rollback")
    if not T then return nil, err end
  elseif T.state == "pending" then
    if not self.engine:holds(T) then
      local now
      now, err = self.engine:server_now()
      if not now then return nil, err end
      local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
      if not self.policy.may_recover(T, age, self.engine:me()) then
        return nil, errors.new("owned", format("held by %s until its lease expires",
          tostring(T.application)), { step = "rollback", id = T._id })
      end
      local claimed
      claimed, err = self.engine:claim(T, nil, now)
      if claimed == nil then return nil, err end
      if not claimed then
        -- still as it was: its holder's deadline has not passed
        local again = self.engine:get(T._id)
        if again and again.state == T.state and again.epoch == T.epoch then
          return nil, errors.new("owned", format("held by %s until its deadline",
            tostring(T.application)), { step = "rollback", id = T._id })
        end
        return self:rollback(t, reason) -- it moved meanwhile: look again
      end
      T = claimed
    end
    T, err = self.engine:cancel(T, reason, "rollback")
    if not T then return nil, err end
  end
  if T.state == "applied" or T.state == "done" then
    return nil, errors.new("state", "the transaction is committed: compensate it instead",
      { step = "rollback", id = T._id })
  end
  local final
  final, err = self.engine:drive(T, nil)
  if final then return nil, errors.new("state", "the transaction committed meanwhile",
    { step = "rollback", id = T._id }) end
  if err.code == "cancelled" then return true end
  return nil, err
end

-- The id of attempt n (default 1) to compensate the transaction with
-- this id: derived from it, so each attempt is created at most once
-- however often (and from wherever) compensate is called.  The first is
-- "compensates:<key>", a later one "compensates:<n>:<key>" (a key starts
-- with its type's letter, never a digit, so no two ids meet).  A string,
-- not a document: it becomes a marker, and FerretDB cannot $pull a
-- document value.
function _M.compensation_id(id, n)
  if n == nil or n == 1 then return "compensates:" .. key(id) end
  return "compensates:" .. n .. ":" .. key(id)
end

local compensate_options = { floors = true }

-- A new transaction with the inverse ops of a committed one, linked by
-- `compensates`.  Attempt n + 1 is begun only once attempt n is
-- cancelled (refused by a floor, say), and cancelled is final: of a
-- transaction's compensations, at most one is ever anything but
-- cancelled, so at most one is done, whoever calls and however many at
-- once (two that begin the same attempt meet on its _id).  Before it
-- begins attempt n + 1, a call records n + 1 on the original
-- (`compensations`, $max): attempts before that one are all cancelled,
-- so the next call reads from there, not from the first (a refund tried
-- daily costs the same on day 1 000 as on day 1).  prune deletes the
-- original before its compensations (it is older).

-- The answer of a compensation that ended cancelled because an op of it
-- could not apply: that op failure's code (`guard` below a floor), the
-- same for the call whose attempt it was and for one that met it in
-- flight, which learns it as `cancelled` with that cause.
local function refusal(C, err)
  if not C and err.code == "cancelled" and engine.failure_text[err.cause] then
    err.code = err.cause
  end
  return C, err
end

--- Undoes a committed transaction with a new one; of its compensations at most one ends `done`.
-- @syntax T, err = tm:compensate(t [, { floors = false }])
-- @tparam table t a `done` (or `applied`) transaction
-- @tparam[opt] table opts `floors` (default true): each debit of the compensation keeps the floor the original's
--   debits of that field had (a transfer's `min`); false: none
-- @treturn table the compensating transaction (`_id` `"compensates:<id>"`, a later attempt's
--   `"compensates:<n>:<id>"`; `compensates` = the original id)
-- @errors `guard` (a floor refused it: it ended cancelled, and a later call tries again), `state`, `cancelled`,
--   `invalid` (a policy's message, or a bad option), database errors
-- @usage local c = assert(tm:compensate(done))
function Manager:compensate(t, opts)
  local err
  opts, err = validate.options(opts, compensate_options, "compensate", CALLER)
  if not opts then return nil, err end
  local T
  T, err = self:_load(t, "compensate")
  if not T then return nil, err end
  if T.state == "applied" then
    T, err = self.engine:drive(T, nil)
    if not T then return nil, err end
  end
  if T.state ~= "done" then
    return nil, errors.new("state", "only a committed transaction can be compensated",
      { step = "compensate", id = T._id })
  end
  -- a hold: what it captured (mongotx.holds)
  local effect = type(T.hold) == "table" and holds.as_captured(T) or T
  local ops, why = self.policy.compensation(effect, { floors = opts.floors ~= false })
  if not ops then
    return nil, errors.new("invalid", why, { step = "compensate", id = T._id })
  end
  local n, raced = T.compensations, false
  if type(n) ~= "number" or n < 1 or n % 1 ~= 0 then n = 1 end
  while true do
    local cid = _M.compensation_id(T._id, n)
    local C
    C, err = self.engine:get(cid)
    if err then return nil, err end
    if not C then
      C, err = self:_begin(ops, { id = cid }, { compensates = T._id })
      if C then
        self.engine:event("compensate", { id = T._id, by = C._id })
        return refusal(self:commit(C))
      end
      -- another call began this attempt first, with other ops (floors):
      -- read it again (once) and go on from there
      if err.code ~= "idempotency" or raced then return nil, err end
      raced = true
    elseif C.state ~= "cancelled" then
      return refusal(self:commit(C)) -- this attempt is the one in flight, or done
    else
      n, raced = n + 1, false
      local res
      res, err = self.engine.tx:update_one({ _id = T._id }, { ["$max"] = { compensations = n } })
      if not res then return nil, errors.wrap(err, "compensate", T._id) end
    end
  end
end

-- Finds stale transactions and drives each to done or cancelled under the
-- policies (mongotx.recovery), opts.batch (default 100) at a time with
-- one round trip per step for the batch; batch = 1 drives each alone.
-- Returns a report: { examined, done, cancelled, skipped, parked, failed,
-- malformed, errors = { {id, error}, ... } }.

-- Deletes finished transactions older than the retention period (or
-- opts.older_than seconds); with opts.limit, only the `limit` oldest of
-- them (a sweep in steps, as `mongotx prune` runs it); with opts.dry_run,
-- none: it counts them.  Returns how many.

--- Deletes `done` and `cancelled` transactions older than the retention.
-- mongotx's own only: a document without `ops` is another writer's and stays.
-- @syntax n, err = tm:prune([{ older_than = seconds, limit = n, dry_run = bool }])
-- @tparam[opt] table opts `older_than` (default the `retention` policy), `limit`, `dry_run`
-- @treturn integer how many were (or would be) deleted
-- @errors `invalid`, database errors
-- @usage local n = assert(tm:prune{ older_than = 3600 })
function Manager:prune(opts)
  local now, err
  opts, err = validate.options(opts, { older_than = true, limit = true, dry_run = true },
    "prune", CALLER)
  if not opts then return nil, err end
  now, err = self.engine:server_now()
  if not now then return nil, err end
  local age = opts.older_than or self.policy.retention
  -- before the ms after `now - age`: the server's clock is read in ms, a
  -- transaction that ended in the ms of the read is 0 s old, and a server
  -- may keep a date finer than the ms it answers (mongo-java-server does:
  -- `$lte` that ms missed it)
  local filter = {
    state = { ["$in"] = { "done", "cancelled" } }, ops = stored.OWN,
    lastModified = { ["$lt"] = core.Date(math.floor(now - age * 1000) + 1) },
  }
  if opts.dry_run then
    local n
    n, err = self.tx:count(filter)
    if not n then return nil, errors.wrap(err, "prune") end
    return opts.limit and math.min(n, opts.limit) or n
  end
  if not opts.limit then return self:_prune_where(filter) end
  -- the `limit` oldest, PRUNE_READ ids a step: a limit of any size holds
  -- one step's ids (and sends them in one $in)
  local deleted = 0
  while deleted < opts.limit do
    local step = math.min(opts.limit - deleted, _M.PRUNE_READ)
    local list
    list, err = self.tx:find_all(filter, { sort = { lastModified = 1 }, limit = step,
                                           projection = { _id = 1 } })
    if not list then return nil, errors.wrap(err, "prune") end
    if #list == 0 then break end
    local ids = {}
    for i, T in ipairs(list) do ids[i] = T._id end
    -- with the conditions above still in the filter: one that moved
    -- meanwhile is not deleted
    local only = { _id = { ["$in"] = ids } }
    for k, v in pairs(filter) do only[k] = v end
    local n
    n, err = self:_prune_where(only)
    if not n then return nil, err end
    deleted = deleted + n
    -- (none deleted: another pruner took them; it goes on from there)
    if #list < step or n == 0 then break end
  end
  return deleted
end

-- Deletes the finished transactions `filter` matches, their placeholders
-- first; how many, or nil, err.
function Manager:_prune_where(filter)
  local ok, err = self:_prune_placeholders(filter)
  if not ok then return nil, err end
  local res
  res, err = self.tx:delete_many(filter, self.engine.wopts)
  if not res then return nil, errors.wrap(err, "prune") end
  return res.deleted
end

-- Deletes the placeholders (csrc/txn_ops.c, fence) of the cancelled
-- transactions with insert ops among those prune is about to delete
-- (`filter`): a former owner stalled for longer than the retention period
-- is the risk this takes.  A placeholder that mongotx has written to since
-- (it carries a marker field) is left alone, and so are malformed
-- transactions.  Read from a cursor PRUNE_READ a reply: a prune without
-- a limit may have any number before it, and holds one reply.
_M.PRUNE_READ = 1000

function Manager:_prune_placeholders(filter)
  local only = { ["ops.kind"] = "insert" }
  for k, v in pairs(filter) do only[k] = v end
  only.state = "cancelled"
  local cursor = self.tx:find(only, { batch_size = _M.PRUNE_READ, sort = { _id = 1 } })
  while true do
    local T, err = cursor:next()
    if not T then
      cursor:close()
      if err then return nil, errors.wrap(err, "prune") end
      return true
    end
    for _, op in ipairs(validate.malformed(T, self.engine.vctx) and {} or T.ops) do
      if op.kind == "insert" then
        local res
        res, err = self.engine:coll(op.collection):delete_one({ _id = op.id,
          [self.engine.fields.placeholder] = stored.mark(T),
          [self.engine:form(T).marker] = { ["$exists"] = false } }, self.engine.wopts)
        if not res then
          cursor:close()
          return nil, errors.wrap(err, "prune", T._id)
        end
      end
    end
  end
end

-- Clears `parked` on a transaction recovery gave up on, and its
-- `attempts` and `triedAt`, so that recovery takes it up again at once
-- (for max_attempts more tries); its `reason` stays for the record.  Returns true, or nil, err:
-- `state` when there is no such transaction or it is not parked (a
-- finished one is not, whatever flag it carries).

--- Clears `parked` and `attempts`, so that recovery takes the transaction up again.
-- @syntax ok, err = tm:unpark(id)
-- @param id the transaction's id
-- @treturn boolean true
-- @errors `state` (no such transaction, or not parked), database errors
-- @usage assert(tm:unpark("o-1"))
function Manager:unpark(id)
  local T, err = self:_get(id, "unpark", CALLER)
  if err then return nil, err end
  if not T then
    return nil, errors.new("state", "no such transaction", { step = "unpark", id = id })
  end
  local res
  res, err = self.tx:update_one({ _id = T._id, parked = true, state = ACTIVE },
    { ["$unset"] = { parked = "", triedAt = "" }, ["$set"] = { attempts = 0 } }, self.engine.wopts)
  if not res then return nil, errors.wrap(err, "unpark", T._id) end
  if res.matched == 0 then
    return nil, errors.new("state", "the transaction is not parked", { step = "unpark", id = T._id })
  end
  self.engine:event("unpark", { id = T._id })
  return true
end

-- The transaction with this id and, for each of its ops, what that op's
-- document carries now: { collection, id, exists, marker (the ids in the
-- marker field), version, held (txHeld), removing (txRemoving), pending
-- (txPending: the escrowed credits of open transactions), escrow
-- (txEscrow: the transactions whose credits those are) }.  Returns
-- T, docs; nil when there is no such transaction; nil, err.  The documents
-- of a malformed transaction (validate.malformed: its op ids may not be
-- fit for a filter) are not read: docs is empty and the third value says
-- what is wrong.

--- A transaction and what each of its op's documents carries now.
-- @syntax T, docs, problem = tm:inspect(id)
-- @param id the transaction's id
-- @treturn ?table the transaction, or nil
-- @treturn table per op `{ collection, id, exists, marker, version, held, removing, pending, escrow }`
-- @treturn ?string for a malformed transaction, what is wrong (docs is then empty)
-- @errors nil, err: database errors
-- @usage local T, docs = tm:inspect("o-1")
function Manager:inspect(id)
  local T, err = self:_get(id, "inspect", CALLER)
  if not T then return nil, err end
  local eng, docs = self.engine, {}
  local why = validate.malformed(T, eng.vctx)
  if why then return T, docs, why end
  local f, form = eng.fields, eng:form(T)
  local projection = { [form.marker] = 1, [form.version] = 1, [f.held] = 1, [f.removing] = 1,
                       [f.pending] = 1, [f.escrow] = 1 }
  for i, op in ipairs(T.ops) do
    local doc
    doc, err = eng:coll(op.collection):find_one({ _id = op.id }, { projection = projection })
    if err then return nil, errors.wrap(err, "inspect", T._id) end
    docs[i] = { collection = op.collection, id = op.id, exists = doc ~= nil,
                marker = doc and doc[form.marker], version = doc and doc[form.version],
                held = doc and doc[f.held], removing = doc and doc[f.removing],
                pending = doc and doc[f.pending], escrow = doc and doc[f.escrow] }
  end
  return T, docs
end

-- One protocol step at a time, as in the tutorial (mongotx.stepwise):
-- claim, apply (op i), commit, finish (op i), done, cancel, undo (op i),
-- cancelled.  Each returns the step's result table, or nil, err.
local STEPS = { claim = true, apply = "op", commit = true, finish = "op", done = true,
                cancel = true, undo = "op", cancelled = true }

--- One protocol step: claim, apply, commit, finish, done, cancel, undo, cancelled.
-- @syntax result, err = tm:step(name, t [, i])
-- @string name the step
-- @tparam table t the transaction
-- @int[opt] i the op's index, for apply, finish and undo
-- @return the step's result (`claim`: the document or false; `apply`: `{ applied = true }`; ...)
-- @errors `state` (out of order), `owned`, `fenced`, an op's reason, database errors
-- @usage assert(tm:step("claim", t)); assert(tm:step("apply", t, 1))
function Manager:step(name, t, i)
  if not STEPS[name] then error("unknown step " .. tostring(name), CALLER) end
  local T, err = self:_load(t, name)
  if not T then return nil, err end
  if STEPS[name] == "op" and not T.ops[i] then error("no op " .. tostring(i), CALLER) end
  return stepwise.step(self.engine, self.stepped, name, T, i)
end

return _M
