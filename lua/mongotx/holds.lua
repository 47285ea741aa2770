-- mongotx.holds: money reserved now and captured (all or part), voided
-- or expired later (docs/holds.md).  A hold is a transfer's transaction
-- applied and left pending: the debit of `from` in place (its floor
-- guard checked at once), the credit of `to` in escrow (`txPending`), so
-- debits, escrowed credits and floor guards there do not wait for it (no
-- `txHeld`); exclusive ops do (docs/guards.md, "Isolation").  Its outcome is decided by
-- one conditioned write on the transaction document, which moves it out
-- of `pending` and so can be won once:
--
--   capture  pending -> applied (the commit point), with what each op's
--            finish adds (`settle`: the captured part to `to`, the rest
--            back to `from`; csrc/txn_ops.c build_finish) when it is
--            part; only while `hold.expires` is ahead of the server's
--            clock ($$NOW);
--   void     pending -> canceling, cause "voided", the same condition;
--   expire   pending -> canceling, cause "expired", once it passed (a
--            capture or void that meets it, or recovery: recovery.lua
--            asks `triage` and `stale_way` here).
--
-- Opening is the create (pending, its deadline the expiry) and the
-- applies (fenced, as a transfer's, by the opener's deadline: its lease,
-- or the expiry when that comes first), nothing more: a hold costs a
-- transfer's writes.  The opener sends each apply once (Engine:retry,
-- `once`: no resend after a lost answer), so once both marks are on the
-- documents no apply of it can land any more; a capture or void checks
-- that (`opened`, one find) before it decides, and a hold without both
-- marks is `opening`.  Nobody owns an open hold: the decisions are
-- conditioned on its state and epoch, not on an owner, and recovery
-- claims a pending hold only past its expiry and its deadline, so one
-- whose opener died is rolled back then, never forward.  Writes issued
-- here pass the crash points hold.<step> (mongotx.points).

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local batch = require "mongotx.batch"
local engine = require "mongotx.engine"
local points = require "mongotx.points"
local checks = require "mongotx.manager.checks"
local CHUNK = require("mongotx.manager.batches").CHUNK

local live, canon = stored.live, validate.canon
local Date = core.Date
local pairs, ipairs, type, tostring, pcall = pairs, ipairs, type, tostring, pcall
local floor, format, huge, min = math.floor, string.format, math.huge, math.min
local setmetatable = setmetatable
local unpack = table.unpack or unpack -- luacheck: ignore 143

local _M = {}

-- Seconds a hold lasts when `expires` is not given.
_M.EXPIRES = 3600

-- Tries of a decision that lost to a write not settling the hold (a recovery claim of an expired one).
local MAX_ROUNDS = 10

local hold_options = { field = true, min = true, id = true, meta = true, expires = true }

local function state_error(T, step, status, message)
  return errors.new("state", message, { step = step, id = T._id, status = status,
    captured = T.hold and T.hold.captured })
end

-- What a hold is: "opening" (pending without both marks: `opened` is
-- false), "held", "captured", "voided", "expired" (decided, or past its
-- expiry and not yet voided: `now`, the server's ms, says), or "failed"
-- (it never opened: a guard refused its debit).
function _M.status(T, now, opened)
  local h, state = T.hold, T.state
  if state == "applied" or state == "done" then return "captured" end
  if state == "canceling" or state == "cancelled" then
    if T.cause == "voided" or T.cause == "expired" then return T.cause end
    return "failed"
  end
  if opened == false then return "opening" end
  if now and core.type(h.expires) == "date" and h.expires:value() <= now then
    return "expired"
  end
  return "held"
end

-- Are both marks of the pending hold T on its documents (every apply of
-- its opener landed)?  One find of their ids (a count scans the whole
-- collection on some servers); true, false, or nil, err.
local function opened(eng, T)
  local a, b = T.ops[1], T.ops[2]
  local docs, err = eng:coll(a.collection):find_all({ _id = { ["$in"] = { a.id, b.id } },
    [eng:form(T).marker] = stored.mark(T) }, { projection = { _id = 1 }, limit = 2, sort = { _id = 1 } })
  if not docs then return nil, errors.wrap(err, "hold", T._id) end
  return #docs == 2
end

-- T (a transaction document) with hold.status set when it is a hold (a pending
-- one's marks read: a failed read leaves it "held"), or the hold as it is now
-- when decided since T was read (its finish or undo may have pulled the marks).
function _M.view(eng, T)
  if type(T) == "table" and type(T.hold) == "table" then
    local open
    if T.state == "pending" then
      open = opened(eng, T)
      local now = open == false and eng:get(T._id)
      if now and (now.state ~= "pending" or now.epoch ~= T.epoch) then T, open = now, nil end
    end
    T.hold.status = _M.status(T, eng:clock(), open)
  end
  return T
end

-- The marks field of T's documents, or nil for a hand-edited T whose
-- recorded field is no field name (Engine:form raises).
local function marker_of(eng, T)
  local ok, form = pcall(eng.form, eng, T)
  return ok and form.marker or nil
end

-- view for a page of transaction documents (`mongotx list`), in bounded
-- reads whatever the page holds: the marks of its pending holds in one
-- find per collection (their documents' ids and marks fields, at most one
-- document an id), and those found without both marks read again in one
-- find (decided since the page was read: shown as they are now).  Sets
-- hold.status on each hold of `list` (a failed read leaves "held");
-- returns list, or nil, err.
function _M.views(eng, list)
  local any = false
  for _, T in ipairs(list) do any = any or type(T.hold) == "table" end
  if not any then return list end -- (no read: not even of the clock)
  local now, err = eng:clock()
  if not now then return nil, err end
  local by_coll, order, pending = {}, {}, {}
  for _, T in ipairs(list) do
    local ops, marker = T.ops, nil
    if type(T.hold) == "table" and T.state == "pending" and type(ops) == "table"
       and type(ops[1]) == "table" and type(ops[2]) == "table" then
      marker = marker_of(eng, T)
    end
    if marker then
      pending[#pending + 1] = T
      for i = 1, 2 do
        local name = ops[i].collection
        local g = by_coll[name]
        if not g then
          g = { ids = {}, seen = {}, fields = {} }
          by_coll[name], order[#order + 1] = g, name
        end
        local k = validate.id_key(ops[i].id)
        if k and not g.seen[k] then g.seen[k], g.ids[#g.ids + 1] = true, ops[i].id end
        g.fields[marker] = true
      end
    end
  end
  local docs = {} -- docs[collection][id key]: _id and marks fields
  for _, name in ipairs(order) do
    local g, projection = by_coll[name], { _id = 1 }
    for f in pairs(g.fields) do projection[f] = 1 end
    local found
    found, err = eng:coll(name):find_all({ _id = { ["$in"] = g.ids } },
      { projection = projection, limit = #g.ids, sort = { _id = 1 } })
    if not found then return nil, errors.wrap(err, "hold") end
    local by_id = {}
    for _, d in ipairs(found) do by_id[validate.id_key(d._id) or ""] = d end
    docs[name] = by_id
  end
  local open, opening = {}, {}
  for _, T in ipairs(pending) do
    local marker, mark, on = marker_of(eng, T), stored.mark(T), true
    for i = 1, 2 do
      local op = T.ops[i]
      local d = docs[op.collection][validate.id_key(op.id) or ""]
      on = on and stored.has_marker(d, marker, mark)
    end
    open[T] = on
    if not on then opening[#opening + 1] = T._id end
  end
  local again = {}
  if #opening > 0 then
    local found
    found, err = eng.tx:find_all({ _id = { ["$in"] = opening } },
      { projection = { state = 1, epoch = 1, cause = 1, hold = 1 }, limit = #opening,
        sort = { _id = 1 } })
    if not found then return nil, errors.wrap(err, "hold") end
    for _, d in ipairs(found) do again[validate.tid_key(d._id)] = d end
  end
  for _, T in ipairs(list) do
    if type(T.hold) == "table" then
      local known = open[T]
      local d = known == false and again[validate.tid_key(T._id)]
      if d and (d.state ~= "pending" or d.epoch ~= T.epoch) and type(d.hold) == "table" then
        known, T.state, T.epoch, T.cause, T.hold = nil, d.state, d.epoch, d.cause, d.hold
      end
      T.hold.status = _M.status(T, now, known)
    end
  end
  return list
end

-- The condition on hold.expires of a decision: ahead of the server's clock
-- (past = false) or not (past = true), by $$NOW where the server evaluates
-- it in a write, else by its clock read now (as the engine's claims).
local function expiry(eng, past)
  local op = past and "$lte" or "$gt"
  if eng:server_deadlines() then
    return { ["$expr"] = { [op] = { "$hold.expires", "$$NOW" } } }
  end
  local now, err = eng:server_now()
  if not now then return nil, err end
  return { ["hold.expires"] = { [op] = Date(floor(now)) } }
end

-- The decision `step` (capture, void, expire) on the open hold T as read:
-- one findAndModify conditioned on its state, epoch and `cond`, setting
-- `set` (and this manager as the one that drives it on).  Returns T as
-- the write left it, false when the condition did not hold, or nil, err.
local function decide(eng, T, step, cond, set)
  local query = { _id = T._id, state = "pending", epoch = T.epoch }
  for k, v in pairs(cond) do query[k] = v end
  set.application, set.instance, set.lease = eng.application, eng.instance, eng.policy.lease
  local update = { ["$set"] = set, ["$inc"] = { epoch = 1 },
                   ["$currentDate"] = { lastModified = true } }
  local res, err = eng:retry(step, T._id, points.write, "hold", step, eng.tx.find_and_modify,
    eng.tx, query, { update = update, new = true, write_concern = eng.wopts.write_concern })
  if not res then return nil, err end
  if not res.value then return false end
  return live(res.value)
end

-- canceling -> cancelled: both undos in one bulk write (a hold's ops are
-- on one collection), then cancelled; when an undo matched nothing (done
-- already, by another that drives it too) the engine's way, which fences.
local function unwind(eng, T)
  if eng:form(T) == eng.own and T.ops[1].collection == T.ops[2].collection then
    local tid = stored.mark(T)
    local items = { { tid = tid, op = T.ops[1] }, { tid = tid, op = T.ops[2] } }
    local res = eng:many("undo", eng:coll(T.ops[1].collection), items)
    if res and res.ok and res.matched == #items then
      eng:event("undo", { id = T._id })
      return eng:move(T, "cancelled")
    end
  end
  return eng:unwind(T)
end

-- Drives a decided T to its final state (done, or cancelled); T as it
-- ends, or nil, err (then recovery finishes it: it is decided).
local function settle(eng, T)
  if T.state == "applied" then
    if eng:form(T) ~= eng.own then return eng:finish(T) end
    local _, err = batch.finish(eng, { T })
    if T.state ~= "done" then return nil, err end -- (a finish refused: still applied)
    return T
  end
  if T.state == "canceling" then return unwind(eng, T) end
  return T
end

-- May the decision `step` be taken on the pending hold T as read?  true
-- when it is open (`checked`: seen so before); T as it is now when it
-- was decided meanwhile (its finish or undo may have pulled the marks
-- before the find); nil, err (`state`, status "opening", when it is
-- still pending at that epoch without both marks).
local function may_decide(eng, T, step, checked)
  if checked then return true end
  local open, err = opened(eng, T)
  if open then return true end
  if open == nil then return nil, err end
  local now
  now, err = eng:get(T._id)
  if err then return nil, err end
  if now and (now.state ~= "pending" or now.epoch ~= T.epoch) then return now end
  return nil, state_error(T, step, "opening", "the hold is not open yet")
end

-- The expiry decision on T (open and pending): true when T is now
-- decided (by this call or another), or nil, err.
local function expire(eng, T)
  local cond, err = expiry(eng, true)
  if not cond then return nil, err end
  local won
  won, err = decide(eng, T, "expire", cond,
    { state = "canceling", reason = "expired", cause = "expired" })
  if won == nil then return nil, err end
  if won then
    eng:event("expire", { id = T._id, amount = T.hold.amount })
    local _
    _, err = settle(eng, won)
    if err then return nil, err end
  end
  return true
end

-- Reads the hold `id` for `step`: T, or nil, err (`state`: none; `invalid`: no hold).
local function load(tm, id, step, level)
  local T, err = tm:_get(id, step, level + 1)
  if err then return nil, err end
  if not T then
    return nil, errors.new("state", "no such hold", { step = step, id = id })
  end
  if type(T.hold) ~= "table" then
    return nil, errors.new("invalid", "transaction " .. tostring(T._id) ..
      " is not a hold", { step = step, id = T._id })
  end
  return T
end

-- The settle fields of a capture of `amount` of T: the part to `to` (op
-- 2), the rest back to `from` (op 1); none for all of it.
local function settles(T, amount, set)
  local held = T.hold.amount
  if amount == held then return set end
  local field = next(T.ops[2].update["$inc"])
  set["ops.0.settle"] = { [field] = held - amount }
  set["ops.1.settle"] = { [field] = amount }
  return set
end

-- The hold of a checked call (opts: validate.options's) at the server's
-- `now` (ms): an entry of batch.lua's shape { T, doc (its own fields as
-- a batch's create inserts them), spec }, or nil, err.  Wrong argument
-- types raise at `level`.
local function prepare(tm, collection, from, to, amount, opts, now, level)
  local expires = opts.expires or _M.EXPIRES
  if not (expires > 0 and expires < huge) then -- (a number: validate.options)
    return nil, errors.new("invalid", "option expires of hold must be more than 0 seconds " ..
      "(a finite number)", { step = "hold" })
  end
  local spec, err = checks.transfer_spec(tm, collection, from, to, amount,
    { field = opts.field, min = opts.min, id = opts.id, meta = opts.meta }, level + 1)
  if not spec then return nil, errors.wrap(err, "hold", nil) end
  if spec.ops[2].effect ~= "escrow" then
    return nil, errors.new("invalid", "a hold's credit must wait in escrow: a manager made " ..
      "with escrow = false cannot hold (its credit would hold the document)", { step = "hold" })
  end
  local eng = tm.engine
  local at = floor(now + expires * 1000)
  local id = spec.id
  if id == nil then id = core.ObjectId() end
  local T = { _id = id, state = "pending", ops = spec.ops, epoch = 1, attempts = 1,
              application = eng.application, instance = eng.instance,
              lease = eng.policy.lease, meta = spec.meta, deadline = Date(at),
              markerField = eng.marker, versionField = eng.version_field,
              mark = stored.new_mark(eng.vctx.collection, id),
              source = from, destination = to, value = amount,
              hold = { amount = amount, expires = Date(at) } }
  local doc = { _id = id, ops = spec.stored, meta = spec.meta, deadline = T.deadline,
                mark = T.mark, source = from, destination = to, value = amount, hold = T.hold }
  return { T = T, doc = doc, spec = spec, expires = expires, err = false, slow = false,
           created = false, applied = false, sent = false, out = false, late = false }
end

-- The opener's deadline for holds `entries`, which fences their applies:
-- its lease's, or the earliest expiry when that comes first (nil: fenced
-- by versions read now, before their create, which is the claim);
-- deadline, versions, or nil, err.
local function opener_deadline(eng, entries)
  local deadline, err = eng:new_deadline()
  if err then return nil, err end
  if deadline then
    local d = deadline:value()
    for _, e in ipairs(entries) do d = min(d, e.T.hold.expires:value()) end
    return Date(d)
  end
  local list = {}
  for i, e in ipairs(entries) do list[i] = e.T end
  local versions
  versions, err = eng:versions_many(list)
  if not versions then return nil, err end
  return false, versions
end

-- Creates the hold of entry e alone (an upsert): true when this call
-- created it, else e.out or e.err is its answer (its id exists already:
-- `again`).  `unsure`: a batch's insert may have created it (the bulk
-- reply cannot say): one it did is this call's.
local function create_one(tm, e, unsure)
  local eng, T = tm.engine, e.T
  if unsure then
    local existing, err = eng:get(T._id)
    if err then e.err = err return false end
    if existing and batch.inserted_here(eng, T, existing) then return true end
    if existing then
      e.out, e.err = _M.again(tm, T, e.spec)
      return false
    end
  end
  local doc = {}
  for k, v in pairs(T) do doc[k] = v end
  doc.ops, doc.lastModified = e.doc.ops, nil
  local res, err = eng:step("create", T._id, eng.tx, doc)
  if not res then e.err = err return false end
  if res.created then return true end
  e.out, e.err = _M.again(tm, T, e.spec)
  return false
end

-- The slow way of a hold an opening batch could not apply at once (an op
-- did not match): its applies one at a time, a step of
-- batch.settle_all (st: the apply's state, or true before it began),
-- which has the holds that wait wait side by side; e.err when it did not
-- open.
local function open_slow(opener, e, st, deadline, versions)
  local eng, T = opener, e.T
  if st == true then
    local vs = {}
    for i in ipairs(T.ops) do
      vs[i] = { marked = e.applied[i] or false, deadline = deadline or nil,
                version = versions and versions[i].version or false }
    end
    st = opener:apply_start(T, vs)
  end
  local ok, why, failure = opener:apply_more(st)
  if ok == false then return st, why end -- a retry due in `why` seconds
  if ok == true then return end
  eng:hold(T._id, nil)
  if ok and ok.state == "canceling" then
    local _, e2 = eng:drive(ok, nil)
    e.err = (not e2 or e2.code == "cancelled") and failure or e2
  else
    e.err = why or errors.new("fenced", "another owner took the hold over while it opened",
      { step = "hold", id = T._id })
  end
end

-- Opens the created holds `entries`: their applies in one bulk write a
-- collection (two with a floor: the guarded debits first), each sent
-- once (Engine:retry, `once`: no resend after a lost answer), fenced by
-- `deadline` or `versions` (versions[k] entry k's); the ones an op did
-- not match alone (open_slow).  Each ends with e.out (held) or e.err (it
-- stays pending: recovery rolls it back once it expired), side by side
-- (batch.settle_all).  A policy that raised fails its hold only.
local function open(tm, entries, deadline, versions)
  local eng = tm.engine
  for _, e in ipairs(entries) do eng:hold(e.T._id, 1) end
  local opener = setmetatable({ once = "apply" }, { __index = eng })
  batch.apply(opener, entries, deadline or nil, versions)
  for _, e in ipairs(entries) do
    if not e.err and e.slow then e.late = true end
  end
  batch.settle_all(opener, entries, deadline or nil, versions, open_slow)
  for _, e in ipairs(entries) do
    eng:hold(e.T._id, nil)
    if not e.err then
      eng:event("hold", { id = e.T._id, amount = e.T.hold.amount, expires = e.expires })
      e.T.hold.status = "held"
      e.out = e.T
    end
  end
end

-- A hold call's checks (those of tm:hold): its entry (prepare), or nil,
-- err; wrong argument types raise at `level`.  mongotx.group checks the
-- hold calls it batches with it.
function _M.check(tm, collection, from, to, amount, opts, level)
  local err
  opts, err = validate.options(opts, hold_options, "hold", level + 1)
  if not opts then return nil, err end
  local now
  now, err = tm.engine:clock()
  if not now then return nil, err end
  return prepare(tm, collection, from, to, amount, opts, now, level + 1)
end

-- hold(tm, collection, from, to, amount, opts): see Manager:hold.
function _M.hold(tm, collection, from, to, amount, opts, level)
  local e, err = _M.check(tm, collection, from, to, amount, opts, level + 1)
  if not e then return nil, err end
  local deadline, versions = opener_deadline(tm.engine, { e })
  if deadline == nil then return nil, versions end
  if create_one(tm, e, false) then open(tm, { e }, deadline, versions) end
  if errors.is_policy(e.err) then error(e.err, 0) end -- the call's own raise, as transfer's
  return e.out or nil, e.err or nil
end

local many_options = { collection = true, from = true, to = true, amount = true }
for k in pairs(hold_options) do many_options[k] = true end

-- Opens the checked holds `entries` as one batch: one insert of them all
-- (the fields they share sent once), their applies (open); those whose
-- insert did not say so created alone (create_one), and opened after the
-- others (e.late).
local function open_batch(tm, entries, now)
  local eng = tm.engine
  local deadline, versions = opener_deadline(eng, entries)
  if deadline == nil then
    for _, e in ipairs(entries) do e.err = versions end
    return
  end
  local stamp = eng:stamp(now)
  for _, e in ipairs(entries) do e.T.lastModified, e.doc.lastModified = stamp, stamp end
  batch.create(eng, entries, { state = "pending", epoch = 1, attempts = 1,
    application = eng.application, instance = eng.instance, lease = eng.policy.lease,
    markerField = eng.marker, versionField = eng.version_field })
  local created, vs = {}, versions and {}
  for k, e in ipairs(entries) do
    if e.created then
      created[#created + 1] = e
      if vs then vs[#created] = versions[k] end
    end
  end
  if #created > 0 then open(tm, created, deadline, vs) end
  for k, e in ipairs(entries) do
    if e.slow == "create" and not e.err then
      e.slow, e.late = false, true
      if create_one(tm, e, true) then
        open(tm, { e }, deadline, versions and { versions[k] })
      end
    end
  end
end

-- Opens the checked holds `entries` (check's, or hold_many's) in batches
-- of at most CHUNK, as transfer_many runs transfers: each ends with e.out
-- (the hold, held) or e.err, and e.late when it was opened alone after
-- the others of its batch.
function _M.open_entries(tm, entries)
  local now, err = tm.engine:clock()
  for first = 1, #entries, CHUNK do
    local chunk = { unpack(entries, first, min(first + CHUNK - 1, #entries)) }
    if now then
      open_batch(tm, chunk, now)
    else
      for _, e in ipairs(chunk) do e.err = err end
    end
  end
end

-- hold_many(tm, list): see Manager:hold_many.
function _M.hold_many(tm, list, level)
  if type(list) ~= "table" then error("hold_many takes a list", level + 1) end
  local now, err = tm.engine:clock()
  if not now then return nil, err end
  local entries, seen = {}, {}
  for i = 1, #list do
    local item = list[i]
    if type(item) ~= "table" then
      error(format("hold_many: item %d is not a table", i), level + 1)
    end
    local opts, e
    opts, err = validate.options(item, many_options, "hold_many item " .. i, level + 1)
    if opts then
      e, err = prepare(tm, opts.collection, opts.from, opts.to, opts.amount, opts, now, level + 1)
    end
    if e and opts.id ~= nil then
      local k = validate.tid_key(e.T._id)
      if seen[k] then
        e, err = nil, errors.new("invalid", format("item %d repeats the id of item %d", i,
          seen[k]), { id = e.T._id })
      end
      seen[k] = i
    end
    if not e then
      err.message, err.step, err.item = format("item %d: %s", i, err.message), "hold_many", i
      return nil, err
    end
    entries[i] = e
  end
  _M.open_entries(tm, entries)
  local results, errs = {}, {}
  for i, e in ipairs(entries) do results[i], errs[i] = e.out or false, e.err or false end
  return results, errs
end

-- A hold whose id exists already: the same hold (ops and amount) is
-- answered as it stands now (one still opening is `in_progress`, one
-- that never opened `cancelled`, as a transfer's key answers); anything
-- else is an idempotency error.
function _M.again(tm, T, spec)
  local existing, err = tm.engine:get(T._id)
  if err then return nil, err end
  local same = existing and type(existing.hold) == "table"
    and existing.hold.amount == T.hold.amount
  if same then
    local ops = {}
    for i, op in ipairs(existing.ops) do
      local o = {}
      for k, v in pairs(op) do o[k] = v end
      o.settle = nil
      ops[i] = o
    end
    same = canon(ops) == canon(spec.ops)
  end
  if not same then
    return nil, errors.new("idempotency", "this id was used for another transaction",
      { step = "hold", id = T._id })
  end
  existing = _M.view(tm.engine, existing)
  local status = existing.hold.status
  if status == "opening" then
    return nil, errors.new("in_progress", "another call is opening this hold: ask again " ..
      "later (recovery rolls it back if that call died)", { step = "hold", id = T._id,
      status = status })
  elseif status == "failed" then
    -- what the first answer said of the refusal (cause, op), as any id's
    local failure = engine.cancelled_error(existing)
    failure.message = "the hold did not open: " .. tostring(existing.reason or "no reason recorded")
    failure.step, failure.status = "hold", status
    return nil, failure
  end
  return existing
end

-- A capture or void whose decision did not win: the hold as it is now.
-- One still pending at the epoch read was decided by nobody: it is past
-- its expiry, so it is expired first.  Returns T, or nil, err.
local function after_lost(eng, T)
  local now, err = eng:get(T._id)
  if not now then
    return nil, err or errors.new("state", "the hold disappeared", { id = T._id })
  end
  if now.state == "pending" and now.epoch == T.epoch then
    local ok
    ok, err = expire(eng, now)
    if not ok then return nil, err end
    now, err = eng:get(T._id)
    if not now then
      return nil, err or errors.new("state", "the hold disappeared", { id = T._id })
    end
  end
  return now
end

-- The decision `step` (capture, void) on the hold T as read, taken or
-- met: until T is decided (by this call, another, or an expiry), at most
-- MAX_ROUNDS times, each a check that it is open (may_decide, once seen
-- open), the conditioned write (decide: `set`; on_event(step, `info`)
-- when it won), or T as it is now when it lost (after_lost).  Returns
-- answer(T) of the decided T (which drives it on and says what the call
-- answers), or nil, err.
local function until_decided(eng, T, step, set, info, answer)
  local checked = false -- both marks seen on (opened): no apply can land any more
  for _ = 1, MAX_ROUNDS do
    local state = T.state
    if state == "applied" or state == "done" or state == "canceling" or state == "cancelled" then
      return answer(T)
    end
    local go, err = may_decide(eng, T, step, checked)
    if not go then return nil, err end
    if go ~= true then
      T = go -- decided meanwhile: answered as it stands
    else
      checked = true
      local cond
      cond, err = expiry(eng, false)
      if not cond then return nil, err end
      local won
      won, err = decide(eng, T, step, cond, set)
      if won == nil then return nil, err end
      if won then
        eng:event(step, info)
        T = won
      else
        T, err = after_lost(eng, T)
        if not T then return nil, err end
      end
    end
  end
  return nil, errors.new("state", "the hold did not settle", { step = step, id = T._id })
end

-- capture(tm, id, amount): see Manager:capture.
function _M.capture(tm, id, amount, level)
  local T, err = load(tm, id, "capture", level + 1)
  if not T then return nil, err end
  if amount ~= nil then
    local ok
    ok, err = validate.amount(amount)
    if not ok then
      err.step, err.id = "capture", T._id
      return nil, err
    end
    if amount > T.hold.amount then
      return nil, errors.new("invalid", format("capture of %s is more than the %s held",
        tostring(amount), tostring(T.hold.amount)), { step = "capture", id = T._id })
    end
  else
    amount = T.hold.amount
  end
  local eng = tm.engine
  return until_decided(eng, T, "capture",
    settles(T, amount, { state = "applied", ["hold.captured"] = amount }),
    { id = T._id, amount = amount, held = T.hold.amount },
    function(D)
      if D.state == "applied" or D.state == "done" then
        if D.hold.captured ~= amount and not (D.hold.captured == nil and amount == D.hold.amount) then
          return nil, state_error(D, "capture", "captured", format("the hold was captured " ..
            "with %s", tostring(D.hold.captured or D.hold.amount)))
        end
        local final, e = settle(eng, D)
        if not final then return nil, e end
        return _M.view(eng, final)
      end
      local _, e = settle(eng, D)
      if e and e.code ~= "cancelled" then return nil, e end
      local status = _M.status(D)
      return nil, state_error(D, "capture", status, "the hold was " .. status)
    end)
end

-- void(tm, id): see Manager:void.
function _M.void(tm, id, level)
  local T, err = load(tm, id, "void", level + 1)
  if not T then return nil, err end
  local eng = tm.engine
  return until_decided(eng, T, "void", { state = "canceling", reason = "voided", cause = "voided" },
    { id = T._id, amount = T.hold.amount },
    function(D)
      if D.state == "applied" or D.state == "done" then
        local _, e = settle(eng, D)
        if e then return nil, e end
        return nil, state_error(D, "void", "captured", format("the hold was captured with %s",
          tostring(D.hold.captured or D.hold.amount)))
      end
      local final, e = settle(eng, D)
      if e and e.code ~= "cancelled" then return nil, e end
      return _M.view(eng, final or eng:get(D._id) or D)
    end)
end

-- The captured hold T as the transfer it amounts to (a copy): each op
-- moves the captured amount, the debit's floor guard what it was, so
-- that its compensation (policy.compensation) gives back what was
-- captured, keeping the floors (tm:compensate).
function _M.as_captured(T)
  local c, held = T.hold.captured or T.hold.amount, T.hold.amount
  local out, ops = {}, {}
  for k, v in pairs(T) do out[k] = v end
  for i, op in ipairs(T.ops) do
    local o = {}
    for k, v in pairs(op) do o[k] = v end
    local sign = i == 1 and -1 or 1
    local field = next(op.update["$inc"])
    o.update = { ["$inc"] = { [field] = sign * c } }
    o.undo = { ["$inc"] = { [field] = -sign * c } }
    o.settle = nil
    local floor_ = type(op.where) == "table" and type(op.where[field]) == "table"
      and op.where[field]["$gte"]
    if type(floor_) == "number" then o.where = { [field] = { ["$gte"] = floor_ - held + c } } end
    ops[i] = o
  end
  out.ops = ops
  return out
end

-- Recovery -------------------------------------------------------------------

-- Why an op's `settle` (what the finish of a capture adds) does not fit
-- its update, or nil: finite positive numbers, each on a path of the
-- update's $inc, no more than an escrowed credit holds, no more than a
-- debit took (validate.malformed asks).
function _M.settle_error(op, update)
  if op.kind ~= "update" or core.type(op.settle) ~= "object" then
    return "settle is not a document of an update op"
  end
  local inc = type(update) == "table" and update["$inc"]
  for path, n in pairs(op.settle) do
    local d = type(inc) == "table" and inc[path]
    if type(n) ~= "number" or n ~= n or n <= 0 or n == huge or type(d) ~= "number" then
      return "settle " .. tostring(path) .. " is not a positive number of the update's $inc"
    end
    if (op.effect == "escrow" and n > d) or (op.effect ~= "escrow" and n > -d) then
      return "settle " .. path .. " is more than the update moves"
    end
  end
end

-- What recovery does with the hold T (mongotx.recovery's triage): a
-- pending one (open, or whose opener died) is claimed once past its
-- expiry by `now` (the claim itself waits for its deadline, the expiry,
-- or later where an opener that had to wait renewed it, by the server's
-- clock), whoever holds it, and never by the "own" route; a decided one
-- as any transaction.
function _M.triage(eng, T, now, age, me)
  if T.state ~= "pending" then
    return eng.policy.may_recover(T, age, me) and "claim" or "skipped"
  end
  local at = core.type(T.hold.expires) == "date" and T.hold.expires:value()
  return at and at <= now and "claim" or "skipped"
end

-- How recovery ends a pending hold it claimed: always back (forward
-- would capture it), as expired; the reason and cause of the cancel.
function _M.stale_way()
  return "back", "expired", "expired"
end

-- The part of recovery's filter that leaves out the pending holds not
-- yet past their expiry at `now` (the server's ms): no pass reads them.
function _M.not_due(now)
  return { state = "pending", ["hold.expires"] = { ["$gt"] = Date(floor(now)) } }
end

return _M
