-- mongotx.holds.open: opening holds (docs/holds.md), one alone
-- (tm:hold), a list as one batch (tm:hold_many) or the hold calls of a
-- mongotx.group batch: each hold's create (pending, its deadline its
-- expiry) and its applies, sent once, fenced by the opener's deadline;
-- nothing more, so a hold costs a transfer's writes.  A batch shares
-- one insert and the bulk applies; what does not go that way settles
-- alone, side by side (mongotx.batch.settle).  mongotx.holds decides
-- the holds opened here.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local batch = require "mongotx.batch"
local settle = require "mongotx.batch.settle"
local engine = require "mongotx.engine"
local checks = require "mongotx.manager.checks"
local views = require "mongotx.holds.views"
local CHUNK = require("mongotx.manager.batches").CHUNK

local canon = validate.canon
local Date = core.Date
local pairs, ipairs, type, tostring = pairs, ipairs, type, tostring
local floor, format, huge, min = math.floor, string.format, math.huge, math.min
local setmetatable = setmetatable
local unpack = table.unpack or unpack -- luacheck: ignore 143

local _M = {}

-- Seconds a hold lasts when `expires` is not given.
_M.EXPIRES = 3600

local hold_options = { field = true, min = true, id = true, meta = true, expires = true }

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
           created = false, applied = false, sent = false, out = false, late = false, busy = false }
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
local function slow_start(opener, e, deadline, versions)
  local vs = {}
  for i in ipairs(e.T.ops) do
    vs[i] = { marked = e.applied[i] or false, deadline = deadline or nil,
              version = versions and versions[i].version or false }
  end
  return opener:apply_start(e.T, vs)
end

local function open_slow(opener, e, st, deadline, versions)
  local eng, T = opener, e.T
  if st == true then st = slow_start(opener, e, deadline, versions) end
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

-- The engine as a hold's opener sees it: each apply sent once.
function _M.opener(eng)
  return setmetatable({ once = "apply" }, { __index = eng })
end

-- Opens the created holds `entries`: their applies in one bulk write a
-- collection (two with a floor: the guarded debits first), each sent
-- once (Engine:retry, `once`: no resend after a lost answer), fenced by
-- `deadline` or `versions` (versions[k] entry k's); the ones an op did
-- not match alone (open_slow).  Each ends with e.out (held) or e.err (it
-- stays pending: recovery rolls it back once it expired), side by side
-- (batch.settle_all).  A policy that raised fails its hold only.
local function open(tm, entries, deadline, versions, hand)
  local eng = tm.engine
  for _, e in ipairs(entries) do eng:hold(e.T._id, 1) end
  local opener = _M.opener(eng)
  batch.apply(opener, entries, deadline or nil, versions)
  for _, e in ipairs(entries) do
    if not e.err and e.slow then e.late = true end
  end
  batch.settle_all(opener, entries, deadline or nil, versions, open_slow, hand)
  for k, e in ipairs(entries) do
    eng:hold(e.T._id, nil)
    if e.busy then
      -- its caller goes on with it (mongotx.group.busy): after the
      -- entries (not indices) it waits for
      if e.busy.st == true then e.busy.st = slow_start(opener, e, deadline, versions and versions[k]) end
      local b = settle.handed(e, deadline or nil, versions and versions[k])
      for n, m in ipairs(b.after) do b.after[n] = entries[m] end
      e.busy = b
    elseif not e.err then
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
local function open_batch(tm, entries, now, hand)
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
  if #created > 0 then open(tm, created, deadline, vs, hand) end
  for k, e in ipairs(entries) do
    if e.slow == "create" and not e.err then
      e.slow, e.late = false, true
      if create_one(tm, e, true) then
        open(tm, { e }, deadline, versions and { versions[k] }, hand)
      end
    end
  end
end

-- Opens the checked holds `entries` (check's, or hold_many's) in batches
-- of at most CHUNK, as transfer_many runs transfers: each ends with e.out
-- (the hold, held) or e.err, and e.late when it was opened alone after
-- the others of its batch.  With `hand` (mongotx.group), one whose
-- apply must wait for a retry ends with e.busy instead: what its caller
-- needs to go on with it (settle.handed; its `after` as entries).
function _M.open_entries(tm, entries, hand)
  local now, err = tm.engine:clock()
  for first = 1, #entries, CHUNK do
    local chunk = { unpack(entries, first, min(first + CHUNK - 1, #entries)) }
    if now then
      open_batch(tm, chunk, now, hand)
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
  existing = views.view(tm.engine, existing)
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

_M.open_slow = open_slow

return _M
