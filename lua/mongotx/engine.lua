-- The state machine: drives one transaction, or (with mongotx.batch) a
-- batch of them, through the protocol's steps (a core.steps object bound
-- to this engine's field names and write concern; csrc/txn*.c),
-- under the policies of mongotx.policy.  mongotx.manager (the API),
-- mongotx.batch, mongotx.recovery and mongotx.stepwise use it through
-- its methods and the fields of its context, declared in new() below;
-- nothing else of it.
--
-- States move initial -> pending -> applied -> done, or pending ->
-- canceling -> cancelled; `applied` is the commit point.  An owner holds a
-- transaction by its `epoch` (incremented by every claim); the engine
-- remembers the epochs it holds.  Applies are fenced by document versions
-- read before the claim and by the owner's deadline (csrc/txn.c): a
-- stalled former owner can never apply an op twice.  Guards never read an
-- effect that may still be undone (csrc/txn.h, "Guards"; release in
-- mongotx.engine.phases).
--
-- This module owns the engine's context, its reads and claims; the
-- phases of a claimed transaction (apply, finish, cancel, undo, drive)
-- are mongotx.engine.phases, its applies' retries and give-backs
-- mongotx.engine.applies, the waits for and takeovers of one another
-- owner holds mongotx.engine.holders, and the reads of its documents'
-- versions mongotx.engine.bands, methods of the same class.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local clock = require "mongotx.clock"
local phases = require "mongotx.engine.phases"
local holders = require "mongotx.engine.holders"
local applies = require "mongotx.engine.applies"
local commands = require "mongotx.engine.commands"
local bands = require "mongotx.engine.bands"

local ipairs, pairs, tostring, setmetatable = ipairs, pairs, tostring, setmetatable
local REMOVING, HELD, PLACEHOLDER, PENDING, ESCROW =
  stored.REMOVING, stored.HELD, stored.PLACEHOLDER, stored.PENDING, stored.ESCROW

local _M = {}

local Engine = {}
Engine.__index = Engine

-- The fields of a transaction mongotx.metrics's reconcile reads.
_M.STATES = { state = 1, reason = 1, cause = 1, deadline = 1 }


-- ctx, the engine's context: { db = the database handle, tx = the
-- transactions collection and `collection` its name, policy = the policy
-- table, application, marker, version_field, write_concern, fencing
-- ("auto", "deadline" or "version"), escrow (credits of the transactions
-- it begins wait in `txPending` until their finish) }.  The engine adds `instance` (this engine's owner id),
-- `fields` (the names of the fields mongotx keeps on documents), `steps`
-- (the C core's steps bound to those names and the write concern), `vctx`
-- (what validate needs: the transactions collection, the fields ops
-- may not touch, the longest collection name an op may name in this
-- database: core.MAX_NAMESPACE, and escrow) and `wopts` (the write options of its other writes); all
-- of these are read-only for its users.
function _M.new(ctx)
  local self = setmetatable({
    db = ctx.db,
    tx = ctx.tx,
    policy = ctx.policy,
    application = ctx.application,
    -- "<database>.<collection>" of its transactions: on_event's third argument
    namespace = ctx.db.name .. "." .. ctx.collection,
    instance = core.ObjectId():value(),
    marker = ctx.marker,
    version_field = ctx.version_field,
    fencing = ctx.fencing,
    fields = { marker = ctx.marker, version = ctx.version_field, removing = REMOVING,
               held = HELD, placeholder = PLACEHOLDER, pending = PENDING, escrow = ESCROW },
    vctx = { collection = ctx.collection,
             owned = { "_id", ctx.marker, ctx.version_field, REMOVING, HELD, PLACEHOLDER,
                       PENDING, ESCROW },
             name_max = math.max(0, core.MAX_NAMESPACE - #ctx.db.name - 1),
             escrow = ctx.escrow },
    wopts = { write_concern = ctx.write_concern },
    steps = core.steps { marker = ctx.marker, version = ctx.version_field,
                         removing = REMOVING, held = HELD, placeholder = PLACEHOLDER,
                         pending = PENDING, escrow = ESCROW, write_concern = ctx.write_concern },
    forms = {},         -- the forms of transactions begun with other fields (form)
    colls = {},         -- collection handles by name (coll)
    held = {},          -- key(id) -> epoch this engine holds (hold, holds)
    stalled = {},       -- key(id) -> { epoch, tries } of a holder resolve claimed and could not drive to its end
    server_clock = clock.new(ctx.db), -- (server_now, clock)
    use_deadline = nil, -- does the server evaluate $$NOW (deadlines)
    unsure = {},        -- documents an apply's lost reply left (engine.bands)
  }, Engine)
  self.own = { marker = self.marker, version = self.version_field, steps = self.steps }
  return self
end

-- Helpers -----------------------------------------------------------------

-- A transaction id as a table key (validate.tid_key).
local key = validate.tid_key

local live, mark = stored.live, stored.mark

-- The form of T: the fields its documents carry its marker and version
-- in, those it was begun with (recorded; for an older build's T, this
-- manager's), and the steps bound to them: { marker, version, steps }.
-- Every write and read of T's documents goes through it, whoever drives
-- T (docs/guards.md, "Data model").  A recorded name that is no field name (a
-- hand-edited transaction, which validate.malformed and fields_error
-- report first) raises.
function Engine:form(T)
  local marker, version = T.markerField, T.versionField
  if marker == nil then marker = self.marker end
  if version == nil then version = self.version_field end
  if marker == self.marker and version == self.version_field then return self.own end
  local k = tostring(marker) .. "\0" .. tostring(version)
  local f = self.forms[k]
  if not f then
    local why = validate.fields_error(T)
    if why then error("mongotx: transaction " .. tostring(T._id) .. ": " .. why, 2) end
    f = { marker = marker, version = version,
          steps = core.steps { marker = marker, version = version, removing = REMOVING,
                               held = HELD, placeholder = PLACEHOLDER, pending = PENDING,
                               escrow = ESCROW, write_concern = self.wopts.write_concern } }
    self.forms[k] = f
  end
  return f
end

-- The default on_event does nothing: a batch's events (five per
-- transaction) then cost no table and no call.  Every event tells the
-- namespace of the transactions (a registry keeps the marks of each
-- apart: mongotx.metrics.marks).
local quiet = require("mongotx.policy").on_event

function Engine:event(name, info)
  pcall(self.policy.on_event, name, info, self.namespace)
end

-- Does anyone listen (policy.on_event other than the default)?  A batch
-- asks once, not at each of its transactions' five events.
function Engine:listening()
  return self.policy.on_event ~= quiet
end

-- event(name, { id = id }), when anyone listens.
function Engine:event_id(name, id)
  local on_event = self.policy.on_event
  if on_event ~= quiet then pcall(on_event, name, { id = id }, self.namespace) end
end

function Engine:coll(name)
  local c = self.colls[name]
  if not c then
    c = self.db.client:collection(self.db.name, name)
    self.colls[name] = c
  end
  return c
end

-- Calls fn(...) again after a backoff while it fails with a transient
-- error, at most policy.retries times; never step `self.once` (a hold's
-- opener sends each apply once: mongotx.holds).
-- (The first call is outside the loop: LuaJIT records no trace through a
-- vararg call in a loop of the vararg function.)
function Engine:retry(step, id, fn, ...)
  local res, err = fn(...)
  if res ~= nil then return res end
  local attempt = 0
  while true do
    if not (err and err.transient) or attempt >= self.policy.retries or step == self.once then
      return nil, errors.wrap(err, step, id)
    end
    attempt = attempt + 1
    if self.policy.on_event ~= quiet then
      self:event("retry", { id = id, step = step, reason = err.code })
    end
    self.policy.sleep(self.policy.backoff(attempt))
    res, err = fn(...)
    if res ~= nil then return res end
  end
end

-- Runs step `name` of the transaction with this id (csrc/txn.c: create,
-- claim, apply, commit, finish, done, cancel, undo, fence, cancelled,
-- renew) with retries, and reports it to on_event under that name.
function Engine:step(name, id, ...)
  local steps = self.steps
  local res, err = self:retry(name, id, steps[name], steps, ...)
  if res ~= nil and self.policy.on_event ~= quiet then
    self:event(name, { id = id, result = res })
  end
  return res, err
end

-- A `malformed` error when T's recorded fields cannot drive it (form
-- would raise), else nil: for the entry points of one transaction (drive,
-- tm:step), which may be handed a hand-edited one.
function Engine:fields_error(T)
  local why = validate.fields_error(T, self.vctx.collection)
  if why then
    return errors.new("malformed", "malformed transaction, left as it is: " .. why,
      { id = T._id })
  end
end

-- Runs step `name` (apply, finish, undo, fence) of T on op's document in
-- collection handle `coll`, with T's form and mark, like step.
function Engine:op_step(T, name, coll, op, ...)
  local form = self:form(T)
  local steps, fn = form.steps, form.steps[name]
  if name == "apply" then fn = bands.apply_one(self, op.collection, form.version, fn) end
  if name == "undo" then fn = bands.undo_one(self, op.collection, form.version, fn) end
  local res, err = self:retry(name, T._id, fn, steps, coll, mark(T), op, ...)
  if res ~= nil and self.policy.on_event ~= quiet then
    self:event(name, { id = T._id, result = res })
  end
  return res, err
end

-- Runs the batched form of step `name` (create, claim, apply, commit,
-- finish, done, undo, fence, cancelled) with retries; the batch reports
-- its own events.
-- Engine:many's steps through engine.commands: as many write commands as
-- the server takes (a function of its own: a closure made in Engine:many
-- kept LuaJIT from compiling it).
local function in_commands(self, name, fn, steps, ...)
  return commands.run(self.db.client, name, function(...)
    return self:retry(name, nil, fn, steps, ...)
  end, ...)
end

local MANY = setmetatable({}, { __index = function(t, name) t[name] = name .. "_many"; return t[name] end })
function Engine:many(name, ...)
  local steps = self.steps
  local fn = name == "apply" and bands.banded_apply(self) or steps[MANY[name]]
  -- a server found to evaluate $$NOW (deadlines) is not FerretDB v1: one
  -- write command whatever the count
  if self.use_deadline then return self:retry(name, nil, fn, steps, ...) end
  return in_commands(self, name, fn, steps, ...)
end

-- The server's clock (ms since the epoch), read now (mongotx.clock).
function Engine:server_now()
  return self.server_clock:read()
end

-- The transaction with this id (checked like a caller's id: {$gt = ""}
-- must not find another one), or nil; nil, err.
function Engine:get(id)
  local sent, err = validate.check_tid(id)
  if sent == nil then return nil, err end
  local doc
  doc, err = self.tx:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, nil, id) end
  return live(doc)
end

-- The state (and reason, cause, deadline) of the transactions with these
-- ids (at most 1000, each checked like a caller's), in one bounded read,
-- for mongotx.metrics's reconcile; nil, err.
function Engine:states(ids)
  local sent = {}
  for i = 1, math.min(#ids, 1000) do sent[#sent + 1] = validate.check_tid(ids[i]) end
  local docs, err = self.tx:find_all({ _id = { ["$in"] = sent } },
    { projection = _M.STATES, sort = { _id = 1 }, limit = #sent })
  if not docs then return nil, errors.wrap(err, "reconcile") end
  return docs
end

-- Makes this engine write through the transactions collection `tx` (of
-- another client of the same deployment; ctx.db.client is that client
-- too): the handles made from the old client are dropped.  mongotx.pool
-- lends each call a client of its pool this way.
function Engine:use(tx)
  self.tx, self.colls = tx, {}
end

-- Marks T (its id) as held by this engine at `epoch`, or not (nil).
-- Returns the id's key, which a later hold of the same id may pass as
-- `k` (a batch holds and releases each of its transactions: one key).
function Engine:hold(id, epoch, k)
  k = k or key(id)
  self.held[k] = epoch
  return k
end

-- The server's clock in ms, estimated (mongotx.clock): only the length of
-- an owner's window depends on it, not safety (applies and claims both
-- compare deadlines with the server's clock).
function Engine:clock()
  return self.server_clock:now()
end

-- The lastModified of the transactions a batch inserts (an insert cannot
-- $currentDate): `now`, the server's clock as estimated, but later than
-- any this engine stamped before, as the estimate can step back when the
-- clock is measured again.  A batch tells its own inserts from an earlier
-- call's by it (batch.lua, inserted_here).
function Engine:stamp(now)
  local ms = math.floor(now)
  local last = self.last_stamp
  if last and ms <= last then ms = last + 1 end
  self.last_stamp = ms
  return core.Date(ms)
end

-- Does the server evaluate $$NOW in a write's filter, as the applies and
-- claims send it?  DocumentDB (FerretDB v2) evaluates it in reads but
-- refuses it in update and findAndModify unless
-- documentdb.enableVariablesSupportForWriteCommands is on; FerretDB v1
-- refuses it everywhere.  Both look at the rest of a filter only on a
-- document its _id found, so the probe updates one: `<transactions>.probe`
-- holds it (upserted; a document in the transactions collection would
-- meet recovery), and its condition, false, leaves it as it is.
local function now_in_writes(self)
  local probe = self.db.client:collection(self.db.name, self.tx:name() .. ".probe")
  if not probe:update_one({ _id = "now" }, { ["$set"] = { probe = true } }, { upsert = true }) then
    return false
  end
  return probe:update_one({ _id = "now", ["$expr"] = { ["$lt"] = { "$$NOW", core.Date(0) } } },
                          { ["$set"] = { probe = true } }) ~= nil
end

-- Are this manager's applies fenced by a deadline (csrc/txn.c)?  When
-- the server evaluates $$NOW in a write's filter (asked once) and the
-- lease is not 0: a deadline of now would expire before the first apply.
function Engine:deadlines()
  if self.use_deadline == nil then
    if self.fencing == "auto" then
      self.use_deadline = now_in_writes(self)
    else
      self.use_deadline = self.fencing == "deadline"
    end
  end
  return self.use_deadline and self.policy.lease > 0
end

-- Does the server compare deadlines with its own clock for this manager
-- ($$NOW, found as deadlines does), whatever its lease?
function Engine:server_deadlines()
  self:deadlines()
  return self.use_deadline
end

-- The time a recovery pass judges ages and staleness by, and claims
-- with: the clock's estimate where claims compare deadlines on the
-- server (claim_terms), else the server's clock, read now.
function Engine:pass_now()
  if not self:server_deadlines() then return self:server_now() end
  local now, err = self:clock()
  return now and math.floor(now), err
end

-- A deadline this manager's lease from now, or nil when it fences by
-- versions alone.
function Engine:new_deadline()
  if not self:deadlines() then return nil end
  local now, err = self:clock()
  if not now then return nil, err end
  return core.Date(math.floor(now + self.policy.lease * 1000))
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
function Engine:claim(T, set, now)
  local deadline, err = self:claim_deadline(T, set)
  if err then return nil, err end
  if not now and T.deadline ~= nil and T.state == "pending" and not self:server_deadlines() then
    now, err = self:server_now()
    if not now then return nil, err end
  end
  local expect
  expect, set = self:claim_terms(T, set, now, deadline)
  local doc
  doc, err = self:step("claim", T._id, self.tx, T._id, expect, set)
  if doc == nil then return nil, err end
  if doc then self.held[key(T._id)] = doc.epoch end
  return live(doc)
end

-- Does a claim of T (`set` as for claim) leave it pending?
local function leaves_pending(T, set)
  return T.state == "pending" or (set and set.state) == "pending"
end

-- The deadline a claim of T sets: this owner's applies are fenced by its
-- own deadline (csrc/txn.c), so one for a claim that leaves T pending;
-- nil otherwise, or when deadlines do not fence.
function Engine:claim_deadline(T, set)
  if leaves_pending(T, set) then return self:new_deadline() end
end

-- What a claim of T expects and what it sets (claim above, claim_many):
-- T's state and epoch as read and, for a pending T that carries a
-- deadline, that it passed: by the server's clock as the claim runs
-- ($$NOW) where the server evaluates it, else before `now` (the server's
-- time, read); it sets this owner, `set`'s fields and `deadline`
-- (claim_deadline).  So a claim never comes before the deadline the
-- owner's applies are fenced by, however far off this engine's estimate
-- of the server's clock (clock) is.
function Engine:claim_terms(T, set, now, deadline)
  set = set or {}
  set.application, set.instance, set.lease = self.application, self.instance, self.policy.lease
  set.deadline = deadline
  local expect = { state = T.state, epoch = T.epoch or 0 }
  if T.deadline ~= nil and T.state == "pending" then
    if self:server_deadlines() then
      expect["$expr"] = { ["$lt"] = { "$deadline", "$$NOW" } }
    else
      expect.deadline = { ["$lt"] = core.Date(now) }
    end
  end
  return expect, set
end

-- Claims many transactions in one bulk write: list[i] = { T =, set = }
-- as for claim, `now` the server's time read before, `deadline` the one
-- every claim that leaves its transaction pending sets.  Returns, for
-- each, the claimed transaction (as the claim left it) or false when
-- somebody else moved it first; nil, err when the write failed (then
-- some claims may have been won: their leases expire, nothing else
-- happened).  A bulk write counts only the matches of the whole batch:
-- when they fall short, one read tells which claims were won (the epoch
-- each moved on, with this owner's instance).  A transaction listed twice
-- (a cursor returns a document that moved while it ran) is won once: the
-- second claim matched nothing.
function Engine:claim_many(list, now, deadline)
  local items, ids = {}, {}
  for i, c in ipairs(list) do
    local expect, set = self:claim_terms(c.T, c.set, now,
      leaves_pending(c.T, c.set) and deadline or nil)
    items[i] = { tid = c.T._id, expect = expect, set = set }
    ids[i] = c.T._id
  end
  local res, err = self:many("claim", self.tx, items)
  if not res then return nil, err end
  local by_id
  if not (res.ok and res.matched == #items) then
    local docs
    docs, err = self.tx:find_all({ _id = { ["$in"] = ids } }, { sort = { _id = 1 } })
    if not docs then return nil, errors.wrap(err, "claim") end
    by_id = {}
    for _, doc in ipairs(docs) do by_id[key(doc._id)] = doc end
  end
  local out = {}
  for i, c in ipairs(list) do
    local T, epoch = c.T, (c.T.epoch or 0) + 1
    local doc
    if by_id then
      local k = key(T._id)
      doc = by_id[k]
      if not (doc and doc.epoch == epoch and doc.instance == self.instance) then doc = false end
      if doc then by_id[k] = nil end -- won at most once
    else
      -- every claim matched: T as the claim left it
      doc = {}
      for k, v in pairs(T) do doc[k] = v end
      for k, v in pairs(items[i].set) do doc[k] = v end
      doc.epoch, doc.attempts = epoch, (T.attempts or 0) + 1
    end
    if doc then
      self.held[key(T._id)] = epoch
      self:event("claim", { id = T._id, result = doc })
    end
    out[i] = doc and live(doc)
  end
  return out
end

-- This manager as the ownership policy sees it.
function Engine:me()
  return { application = self.application, instance = self.instance,
           stale_after = self.policy.stale_after, lease = self.policy.lease }
end

-- Does this engine hold T at its epoch (in whatever state)?
function Engine:holding(T)
  return T.epoch ~= nil and self.held[key(T._id)] == T.epoch
end

function Engine:holds(T)
  return T.state == "pending" and self:holding(T)
end

-- The phases (apply, finish, cancel, undo, drive): mongotx.engine.phases;
-- a transaction another owner holds (lapsed, await, take_over):
-- mongotx.engine.holders; the documents' versions: mongotx.engine.bands.
for name, method in pairs(phases.methods) do Engine[name] = method end
for name, method in pairs(holders.methods) do Engine[name] = method end
for name, method in pairs(applies.methods) do Engine[name] = method end
for name, method in pairs(bands.methods) do Engine[name] = method end

_M.key, _M.op_failure, _M.failure_text = key, phases.op_failure, phases.failure_text
_M.cause_of, _M.cancelled_error = phases.cause_of, phases.cancelled_error

return _M