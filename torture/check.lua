-- The invariants every torture section checks, read from the database
-- after the final recovery:
--   1. every transaction ended done or cancelled (none parked, none in
--      flight), and a compensating one only for a done original;
--   2. no document carries a marker (pendingTransactions, or OTHER's
--      marker), a holder (txHeld) or an escrow holder (txEscrow) any
--      more; no transaction is done with a marker or an escrowed credit
--      of it left on a document, and no txHeld entry is left without its
--      marker;
--   3. the documents are exactly the fixture with the ops of the done
--      transactions applied once each and those of the cancelled ones not
--      at all: a model replays the done transactions' stored ops ($inc,
--      $set, insert, remove, assert) on the fixture and every field of
--      every document must match (an op applied twice, half a transaction,
--      a lost or a doubled write all show up as a difference);
--   4. the balances of `accounts` sum to what they summed to before, and
--      no account with a `floor` field ends below it (the floor observer,
--      torture/observer.lua, watches them while a section runs);
--   5. what callers were told holds: a transaction reported done is done,
--      one reported cancelled (code cancelled/guard/missing/conflict) is
--      cancelled; and optional per-id allowed final states;
--   6. one serial order on the shared logs of torture/serial.lua (no
--      cycle, no entry twice, none lost, none of a transaction not done),
--      which the model leaves to it.
--
--   local r = check.database(db, fixture, { allowed = {...}, reported = {...} })
--   r.violations (list of messages), r.states (id -> state), r.counts

local mongotx = require "mongotx"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local serial = require "torture.serial"

-- Ids as map keys and in messages: strings as they are (every id the
-- suite makes is one), anything else in the engine's canonical form.
local function canon(id)
  if type(id) == "string" then return id end
  return validate.canon(id)
end

local M = {}

M.MARKER, M.VERSION = "pendingTransactions", "txVersion"
-- the ids of open transactions whose effect on a document may raise a
-- value (README, Guards): bookkeeping like the marker, empty at the end
M.HELD = "txHeld"
-- the escrowed credits of open transactions (docs/guards.md, Escrow):
-- every path there must end at 0, each credit moved in or taken back
M.PENDING = "txPending"
-- the open transactions with an escrowed credit there, by their marks
M.ESCROW = "txEscrow"
-- The other configuration the sections with mixed managers use (issue
-- 27): another transactions collection (whose transactions are keyed
-- "tx2:<id>" here, their ids may repeat those of `transactions`), and
-- another marker and version field.  Every marker array must end empty.
M.OTHER = { collection = "tx2", marker = "otherMarker", version = "otherVersion" }
local MARKERS = { M.MARKER, M.OTHER.marker }

local function copy(doc)
  local out = {}
  for k, v in pairs(doc) do out[k] = v end
  return out
end

local function equal(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  for k, v in pairs(a) do
    if not equal(v, b[k]) then return false end
  end
  for k in pairs(b) do
    if a[k] == nil then return false end
  end
  return true
end

local function show(v)
  if type(v) ~= "table" then return tostring(v) end
  local parts = {}
  for k, x in pairs(v) do parts[#parts + 1] = tostring(k) .. "=" .. show(x) end
  table.sort(parts)
  return "{" .. table.concat(parts, ",") .. "}"
end

-- Applies one op of a done transaction to the model (of a hold, `hold`:
-- its hold field); a message when it cannot (then the database cannot be
-- right either).
local function replay(model, op, tid, hold)
  if op.collection == serial.COLLECTION then return end -- serial.final's
  local coll = model.docs[op.collection] or {}
  model.docs[op.collection] = coll
  local k = canon(op.id)
  local doc = coll[k]
  local where = ("op %s/%s of %s"):format(op.collection, tostring(op.id), tostring(tid))
  if op.kind == "insert" then
    if doc then return where .. ": inserted over an existing document" end
    local d = copy(op.doc)
    d._id = op.id
    coll[k] = d
    return
  end
  if not doc then
    local gone = model.removed[op.collection .. "/" .. k]
    return where .. ": its document does not exist" ..
      (gone and (" (" .. gone .. " removed it, and both are done)") or "")
  end
  if op.kind == "remove" then
    coll[k] = nil
    model.removed[op.collection .. "/" .. k] = tostring(tid)
  elseif op.kind == "update" then
    for operator, fields in pairs(op.update) do
      for f, v in pairs(fields) do
        if operator == "$inc" and hold then
          -- a captured hold moves what it captured (`settle` gives the
          -- rest back: csrc/txn_ops.c, build_finish), whatever it held
          doc[f] = (doc[f] or 0) + (v < 0 and -1 or 1) * (hold.captured or hold.amount)
        elseif operator == "$inc" then
          doc[f] = (doc[f] or 0) + v
        elseif operator == "$set" then
          doc[f] = v
        else
          return where .. ": the model cannot replay " .. operator
        end
      end
    end
  end
end

-- The first path of an escrow subdocument whose amount is not 0, as
-- "path = amount", or nil.
local function escrowed(pending, prefix)
  if type(pending) == "number" then
    if pending ~= 0 then return ("%s = %s"):format(prefix, tostring(pending)) end
    return nil
  end
  if type(pending) ~= "table" then return nil end
  for k, v in pairs(pending) do
    local stuck = escrowed(v, prefix == "" and tostring(k) or prefix .. "." .. tostring(k))
    if stuck then return stuck end
  end
end

-- The document as the model sees it: without marker, version and holders,
-- and absent when it is an insert's placeholder (README, known limit 3).
local function visible(doc)
  if doc.txPlaceholder ~= nil then return nil end
  local d = copy(doc)
  d[M.MARKER], d[M.VERSION], d[M.HELD], d[M.PENDING], d[M.ESCROW] = nil, nil, nil, nil, nil
  d[M.OTHER.marker], d[M.OTHER.version] = nil, nil
  return d
end

-- The key r.docs has the transaction a mark names under (its _id's
-- canonical form, prefixed by its collection outside `transactions`).
local function mark_key(mark)
  local coll, id = stored.named(mark)
  if coll and coll ~= "transactions" then return coll .. ":" .. canon(id) end
  return canon(id == nil and mark or id)
end

-- The txHeld entries of doc without their marker (in either marker
-- array), by mark_key: never there at any moment, since an apply pushes
-- both in one write and a finish or an undo pulls both (the floor
-- observer checks it at every poll).
function M.orphan_holds(doc)
  local out, marked = {}, {}
  for _, field in ipairs(MARKERS) do
    for _, mark in ipairs(type(doc[field]) == "table" and doc[field] or {}) do
      marked[mark_key(mark)] = true
    end
  end
  for _, mark in ipairs(type(doc[M.HELD]) == "table" and doc[M.HELD] or {}) do
    if not marked[mark_key(mark)] then out[#out + 1] = mark_key(mark) end
  end
  return out
end

-- What doc carries that no settled protocol leaves (docs: mark_key ->
-- the transaction): a mark (marker, txHeld, txEscrow: its escrowed
-- credit) of a transaction that is done, and a txHeld entry whose marker
-- is gone.  A list of messages.
function M.leftovers(doc, docs)
  local out = {}
  for _, field in ipairs { M.MARKER, M.OTHER.marker, M.HELD, M.ESCROW } do
    for _, mark in ipairs(type(doc[field]) == "table" and doc[field] or {}) do
      local T = docs[mark_key(mark)]
      if T and T.state == "done" then
        out[#out + 1] = ("transaction %s is done with its mark left in %s"):format(
          mark_key(mark), field)
      end
    end
  end
  for _, k in ipairs(M.orphan_holds(doc)) do
    out[#out + 1] = ("a txHeld entry of %s without its marker"):format(k)
  end
  return out
end

local TERMINAL = { done = true, cancelled = true }
-- codes of an op that could not apply, with which the default policy
-- cancels: busy (another open transaction holds a guarded op's document),
-- removing, contention
local CANCEL_CODES = { cancelled = true, guard = true, missing = true, conflict = true,
                       busy = true, removing = true, contention = true }

-- opts.allowed:  id -> { done = true, cancelled = true, absent = true }
-- opts.reported: id -> "done" | error code, as the caller was told
function M.database(db, fixture, opts)
  opts = opts or {}
  local r = { violations = {}, states = {}, docs = {}, counts = { done = 0, cancelled = 0, other = 0 } }
  local function violation(fmt, ...) r.violations[#r.violations + 1] = fmt:format(...) end

  local txs = {}
  for _, coll in ipairs { "transactions", M.OTHER.collection } do
    -- it reads, once every writer stopped: the one process there is
    local tm = assert(db:manager { application = "checker", collection = coll,
                                   single_writer = true })
    -- batches of 1000: mongo-java-server does not cut a reply at 48 MB;
    -- pages of tm:find's largest limit, by skip (ids of several types
    -- have no range to page by)
    local page, skip = require("mongotx.options").FIND_MAX, 0
    repeat
      local list = assert(tm:find({}, { sort = { _id = 1 }, batch_size = 1000, skip = skip,
                                        limit = page }))
      for _, T in ipairs(list) do
        if coll ~= "transactions" then T.key = coll .. ":" .. canon(T._id) end
        txs[#txs + 1] = T
      end
      skip = skip + #list
    until #list < page
  end
  local model = { docs = {}, removed = {} } -- removed: who removed what
  for name, docs in pairs(fixture) do
    model.docs[name] = {}
    for _, d in ipairs(docs) do model.docs[name][canon(d._id)] = copy(d) end
  end
  local done = {}
  for _, T in ipairs(txs) do
    local id = T.key or canon(T._id)
    r.states[id], r.docs[id] = T.state, T
    if TERMINAL[T.state] then
      r.counts[T.state] = r.counts[T.state] + 1
    else
      r.counts.other = r.counts.other + 1
      violation("transaction %s ended %s%s%s", id, tostring(T.state), T.parked and " (parked)" or "",
        T.reason and (" (reason: " .. tostring(T.reason) .. ")") or "")
    end
    if T.state == "done" then done[#done + 1] = T end
  end
  -- originals first: a compensation undoes what its original did
  table.sort(done, function(a, b)
    if (a.compensates == nil) ~= (b.compensates == nil) then return a.compensates == nil end
    return canon(a._id) < canon(b._id)
  end)
  for _, T in ipairs(done) do
    -- (the original is in the compensation's collection)
    local orig = T.compensates ~= nil and (T.key and T.key:match("^[^:]*:") or "") ..
      canon(T.compensates)
    if orig and r.states[orig] ~= "done" then
      violation("transaction %s compensates %s, which is %s", T.key or canon(T._id),
        orig, tostring(r.states[orig]))
    end
    for _, op in ipairs(T.ops) do
      local why = replay(model, op, T.key or canon(T._id), type(T.hold) == "table" and T.hold)
      if why then violation("%s", why) end
    end
  end

  local sum_before, sum_after = 0, 0
  for _, d in ipairs(fixture.accounts or {}) do sum_before = sum_before + d.balance end
  for name, expected in pairs(model.docs) do
    local actual = {}
    for _, doc in ipairs(assert(db:collection(name):find_all({}, { batch_size = 1000 }))) do
      for _, field in ipairs(MARKERS) do
        local marker = doc[field]
        if marker ~= nil and (type(marker) ~= "table" or #marker > 0) then
          local whose = {}
          for _, id in ipairs(type(marker) == "table" and marker or {}) do
            local T = r.docs[canon(id)] or {}
            whose[#whose + 1] = ("%s %s (epoch %s, application %s, reason %s)"):format(canon(id),
              tostring(T.state or "absent"), tostring(T.epoch), tostring(T.application),
              tostring(T.reason))
          end
          violation("%s/%s still carries markers (%s) of %s", name, tostring(doc._id), field,
            table.concat(whose, ", "))
        end
      end
      local held = doc[M.HELD]
      if held ~= nil and (type(held) ~= "table" or #held > 0) then
        local ids = {}
        for i, id in ipairs(type(held) == "table" and held or {}) do ids[i] = canon(id) end
        violation("%s/%s is still held by %s", name, tostring(doc._id), table.concat(ids, ", "))
      end
      local escrow = doc[M.ESCROW]
      if escrow ~= nil and (type(escrow) ~= "table" or #escrow > 0) then
        local ids = {}
        for i, id in ipairs(type(escrow) == "table" and escrow or {}) do ids[i] = canon(id) end
        violation("%s/%s still has escrowed credits of %s", name, tostring(doc._id),
          table.concat(ids, ", "))
      end
      for _, why in ipairs(M.leftovers(doc, r.docs)) do
        violation("%s/%s: %s", name, tostring(doc._id), why)
      end
      local stuck = escrowed(doc[M.PENDING], "")
      if stuck then
        violation("%s/%s still has %s in %s", name, tostring(doc._id), stuck, M.PENDING)
      end
      local d = visible(doc)
      if d then actual[canon(doc._id)] = d end
      if d and type(d.floor) == "number" and type(d.balance) == "number"
          and d.balance < d.floor then
        violation("%s/%s ends at balance %s, below its floor %s", name, tostring(doc._id),
          tostring(d.balance), tostring(d.floor))
      end
      if d and name == "accounts" then sum_after = sum_after + (d.balance or 0) end
    end
    if name == serial.COLLECTION then
      local docs = {}
      for _, d in pairs(actual) do docs[#docs + 1] = d end
      for _, why in ipairs(serial.final(docs, txs, function(T) return T.key or canon(T._id) end)) do
        violation("%s", why)
      end
    else
      for k, want in pairs(expected) do
        if not actual[k] then
          violation("%s/%s is missing (expected %s)", name, k, show(want))
        elseif not equal(want, actual[k]) then
          violation("%s/%s is %s, expected %s", name, k, show(actual[k]), show(want))
        end
      end
      for k, got in pairs(actual) do
        if not expected[k] then violation("%s/%s should not exist: %s", name, k, show(got)) end
      end
    end
  end
  if sum_before ~= sum_after then
    violation("the balances sum to %s, they summed to %s", tostring(sum_after), tostring(sum_before))
  end

  for id, allowed in pairs(opts.allowed or {}) do
    local state = r.states[canon(id)] or "absent"
    if not allowed[state] then
      local T = r.docs[canon(id)]
      violation("transaction %s ended %s%s", canon(id), state,
        T and T.reason and (" (reason: " .. tostring(T.reason) .. ")") or "")
    end
  end
  for id, said in pairs(opts.reported or {}) do
    local state = r.states[canon(id)] or "absent"
    if said == "done" and state ~= "done" then
      violation("transaction %s was reported done, the database says %s", canon(id), state)
    elseif CANCEL_CODES[said] and state ~= "cancelled" then
      violation("transaction %s was reported cancelled (%s), the database says %s",
        canon(id), said, state)
    end
  end
  r.transactions = #txs
  return r
end

-- A handle on database `name` of the server at uri.  One client per
-- server serves every database (a handle shares the client, with the
-- handle type mongotx.connect returns): no connection per case, and no
-- endSessions warning from FerretDB (which lacks it) at each close.
local clients = {}
function M.db(uri, name)
  local base = clients[uri]
  if not base then
    base = assert(mongotx.connect(uri, { database = name }))
    clients[uri] = base
  end
  return setmetatable({ client = base.client, name = name }, getmetatable(base))
end

-- Creates the fixture's documents in db (each collection emptied first).
function M.load(db, fixture)
  for name, docs in pairs(fixture) do
    local coll = db:collection(name)
    coll:drop()
    if #docs > 0 then assert(coll:insert_many(docs)) end
  end
end

return M
