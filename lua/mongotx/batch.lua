-- The batched protocol: transactions a caller runs at once (eng:run,
-- eng:transfer, eng:commit_many, eng:transfer_many) skip `initial` and the
-- claim.  For a whole batch:
--
--   1. create   one bulk insert of every transaction `pending`, owned by
--               this manager (epoch 1), lastModified by the server's
--               clock as estimated (an insert cannot $currentDate);
--   2. apply    one bulk write per collection for all their ops;
--   3. commit   one update moving them all to `applied`, the commit point;
--   4. finish   one bulk write per collection pulling the markers, and one
--               update moving them all to `done` -- at once, or later and
--               for many commits together (policy.finish = "deferred").
--
-- A single transaction on one collection thus commits in 3 round trips.
--
-- Fencing without a read.  A creator knows nothing of its documents'
-- versions, and reading them would cost a round trip.  Instead each
-- transaction carries a `deadline` (its lease from now, by the server's
-- clock) and the creator's applies match only while `$$NOW < deadline`;
-- Manager:_claim lets no one claim a pending transaction before its
-- deadline, so every apply of the creator runs before any takeover.
-- Servers that cannot evaluate $$NOW in a filter (FerretDB v1, MongoDB
-- before 4.2) get the versions read first instead (4 round trips).
--
-- Whatever does not go the fast way (an op that cannot apply, a
-- transaction taken over, an id that exists already) falls back to the
-- engine's one-at-a-time steps for that transaction only, all such
-- transactions together (mongotx.batch.settle).  Each function
-- takes the engine (mongotx.engine) and uses its methods and context.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local stored = require "mongotx.stored"
local validate = require "mongotx.validate"
local bands = require "mongotx.engine.bands"
local settling = require "mongotx.batch.settle"
local id_key = validate.id_key

local ipairs, pairs, next = ipairs, pairs, next
local floor = math.floor

local _M = {}

local fail, raised_in, guarded = settling.fail, settling.raised_in, settling.guarded

-- Entries: { T = <the transaction, ops as tables>, doc = <its own fields
-- as stored: _id, ops (core.stored_ops), meta and the caller's extra>,
-- err = <why it failed>, slow = <needs the one-at-a-time steps>,
-- applied[i], sent[i] = <op i applied, sent by the batch's apply>, key =
-- <its id's key while the engine holds it (Engine:hold)> }.  The fields
-- all transactions of a batch share are sent once (`common`).


-- Sorts a bulk write's items by their document's _id (op(item) its op),
-- so that concurrent bulk writes lock the documents they share in one
-- order: FerretDB v2 runs a bulk write in one PostgreSQL transaction,
-- and two that lock two hot rows in opposite orders deadlock (PostgreSQL
-- finds it after a second and aborts one).  The sort is stable: of two
-- items on one document the earlier in the batch goes first and takes it
-- (table.sort alone let a later batch-mate take one of two documents and
-- cross the earlier, which only a give-back undoes).
local function sort_by_document(items, op)
  local k, at = {}, {}
  for i, item in ipairs(items) do k[item], at[item] = id_key(op(item).id) or "", i end
  table.sort(items, function(a, b)
    if k[a] ~= k[b] then return k[a] < k[b] end
    return at[a] < at[b]
  end)
  return items
end

local function by_document(items, op)
  local n = #items
  if n < 2 then return items end
  if n == 2 then -- (a transfer's finish: no sort to set up)
    local a, b = id_key(op(items[1]).id) or "", id_key(op(items[2]).id) or ""
    if b < a then items[1], items[2] = items[2], items[1] end
    return items
  end
  return sort_by_document(items, op)
end

-- The op of a bulk write's item, of a finish's piece (by_document).
local function item_op(item) return item.op end
local function piece_op(piece) return piece.ops[1] end

-- The result of a request of a batch that did not fail.
local OK = { ok = true }

-- Step 1: insert them all pending and owned.  An id that exists already
-- is handled the way begin handles it (same ops: its outcome).
local function create(eng, entries, common)
  local docs = {}
  for i, e in ipairs(entries) do docs[i] = e.doc end
  local res, err = eng:many("create", eng.tx, docs, common)
  -- res.items lists the requests that failed only (csrc/txn.c).  A
  -- request a server never ran after an error is not among them (FerretDB
  -- stops there): then inserted counts fewer than the oks
  local oks = #entries
  for _, item in pairs(res and res.items or {}) do
    if not item.ok then oks = oks - 1 end
  end
  local sure, loud = res and res.inserted == oks, eng:listening()
  for i, e in ipairs(entries) do
    local item = res and (res.items[i] or OK)
    if not item then
      fail(e, err)
    elseif item.ok and sure then
      e.created = true
      if loud then eng:event_id("create", e.T._id) end
    elseif item.ok or item.server_code == 11000 then
      -- exists, or not known: settle it alone
      e.slow = "create"
    else
      fail(e, errors.new("server", item.message or "create failed",
        { step = "create", id = e.T._id, server_code = item.server_code }))
    end
  end
end

-- Step 2: apply's writes for items { tid, op, version, entry, i }, one
-- bulk write per collection, all fenced by the same deadline (or none).
-- When a collection's writes matched fewer documents than sent, its
-- markers say which ops applied.
local function apply_items(eng, by_coll, order, deadline)
  for _, name in ipairs(order) do
    local items, coll = by_document(by_coll[name], item_op), eng:coll(name)
    local res, err = eng:many("apply", coll, items, deadline)
    if not res then
      for _, item in ipairs(items) do fail(item.entry, err) end
    elseif res.ok and res.matched + res.inserted == #items then
      -- (res.ok too: mongo-java-server counts a failed insert as inserted)
      for _, item in ipairs(items) do item.entry.applied[item.i] = true end
    else
      local ids = {}
      for k, item in ipairs(items) do ids[k] = item.op.id end
      local docs
      docs, err = coll:find_all({ _id = { ["$in"] = ids } },
        { projection = { [eng.marker] = 1 }, sort = { _id = 1 } })
      if not docs then err = errors.wrap(err, "apply") end
      local by_id = {}
      for _, doc in ipairs(docs or {}) do by_id[id_key(doc._id)] = doc end
      for _, item in ipairs(items) do
        if not docs then
          fail(item.entry, err)
        elseif stored.has_marker(by_id[id_key(item.op.id)], eng.marker, item.tid) then
          item.entry.applied[item.i] = true
        end
      end
    end
  end
end

-- Have all of e's guarded ops applied?
local function guards_passed(e)
  for i, op in ipairs(e.T.ops) do
    if op.where and not e.applied[i] then return false end
  end
  return true
end

-- A transaction of a batch that could not take all its documents gives
-- back those it took before it is settled alone: two batch-mates that
-- each took one the other needs would otherwise wait for each other
-- (settle runs them one after the other; docs/guards.md, "Isolation").
-- Only where the batch's deadline fences (Engine:give_back).
local function give_back(eng, e, deadline)
  local _, err = eng:give_back(e.T, e.applied, deadline)
  if err then fail(e, err) end
end

-- One phase of apply: with_guard true for the guarded ops only, false for
-- the others of the transactions whose guards passed, nil for every op.
local function phase(eng, entries, deadline, versions, with_guard)
  local by_coll, order = {}, {}
  for t, e in ipairs(entries) do
    if not e.err and (with_guard ~= false or guards_passed(e)) then
      for i, op in ipairs(e.T.ops) do
        if not e.applied[i] and (with_guard == nil or with_guard == (op.where ~= nil)) then
          local items = by_coll[op.collection]
          if not items then
            items = {}
            by_coll[op.collection], order[#order + 1] = items, op.collection
          end
          local v = versions and versions[t][i]
          local version = false -- none read: fenced by the deadline alone
          if v then version = v.version end
          -- stored: the ops as the create sent them, which the C step
          -- reads the op's filter and update from (recovery's have none)
          -- tid: the mark (mongotx.stored).  A batch's transactions
          -- all have this manager's form: recovery drives the others
          -- alone (recovery.lua).  takeover: recovery's claims move
          -- versions by a band (mongotx.engine.bands)
          e.sent[i] = true
          items[#items + 1] = { tid = stored.mark(e.T), op = op, version = version, entry = e,
                                i = i, stored = e.doc and e.doc.ops,
                                takeover = bands.takeover(e.T) }
        end
      end
    end
  end
  apply_items(eng, by_coll, order, deadline)
end

-- Step 2: every op of every created transaction.  The guarded ops go
-- first, and the others only for the transactions whose guarded ops all
-- applied: so no credit shows (in `txPending` or in place) whose guarded
-- debit did not apply, no guard reads a batch-mate's uncommitted credit
-- (floor guards over the same accounts stack instead of waiting for each
-- other; csrc/txn.h, "Guards"), and a transaction whose guard fails has
-- nothing to undo.  One more round trip when a batch has both kinds of
-- ops; a batch without guards sends all at once.
local function apply(eng, entries, deadline, versions)
  local guards = false
  for t, e in ipairs(entries) do
    e.applied, e.sent = {}, {}
    for i, op in ipairs(e.T.ops) do
      local v = versions and versions[t][i]
      if v and v.marked then e.applied[i] = true end
      if op.where then guards = true end
    end
  end
  if guards then
    phase(eng, entries, deadline, versions, true)
    phase(eng, entries, deadline, versions, false)
  else
    phase(eng, entries, deadline, versions, nil)
  end
  local loud = eng:listening()
  for _, e in ipairs(entries) do
    if not e.err then
      for i in ipairs(e.T.ops) do
        if not e.applied[i] then e.slow = "apply" end
      end
      if loud and not e.slow then eng:event_id("apply", e.T._id) end
      if e.slow and #entries > 1 then guarded(give_back, eng, e, deadline) end
    end
  end
end

-- Step 3: pending -> applied for all of them in one update.
local function commit(eng, entries)
  local ids = {}
  for i, e in ipairs(entries) do ids[i] = e.T._id end
  local res, err = eng:many("commit", eng.tx, ids, 1)
  if res and res.moved == #ids then
    for _, e in ipairs(entries) do e.T.state = "applied" end
  else
    -- some did not move (taken over meanwhile?): look at each
    local docs
    if res then docs, err = eng.tx:find_all({ _id = { ["$in"] = ids } },
      { projection = { state = 1, epoch = 1 }, sort = { _id = 1 } }) end
    local by_id = {}
    for _, doc in ipairs(docs or {}) do by_id[id_key(doc._id)] = doc end
    for _, e in ipairs(entries) do
      local doc = by_id[id_key(e.T._id)]
      if not docs then
        fail(e, errors.wrap(err, "commit", e.T._id))
      elseif doc and doc.state == "applied" and doc.epoch == 1 then
        e.T.state = "applied"
      else
        e.slow = "commit"
      end
    end
  end
  local loud = eng:listening()
  for _, e in ipairs(entries) do
    eng:hold(e.T._id, nil, e.key) -- past the commit point: nothing to fence
    if loud and e.T.state == "applied" then eng:event_id("commit", e.T._id) end
  end
end

-- Step 4: pull the markers of many committed transactions (one bulk write
-- per collection), then applied -> done in one update.  A transaction
-- with a finish the server refused (or, after a refusal, did not run:
-- FerretDB stops a bulk write there) is not moved with the others: it
-- goes the one-at-a-time way (Engine:finish), which moves it to done only
-- once every finish passed, so that none is done with a marker or an
-- escrowed credit left.  Returns how many are done, and the error of the
-- first that is not (it stays `applied`: recovery finishes it), or nil,
-- err (all stay `applied`).
function _M.finish(eng, list)
  if #list == 0 then return 0 end
  -- the collections, in the order first named; finish_many reads each
  -- transaction's ops in one of them
  local seen, order = {}, {}
  for _, T in ipairs(list) do
    for _, op in ipairs(T.ops) do
      local name = op.collection
      if not seen[name] then seen[name], order[#order + 1] = true, name end
    end
  end
  local alone = {}
  for _, name in ipairs(order) do
    -- one piece per op of this collection, in the order of their documents
    local pieces = {}
    for _, T in ipairs(list) do
      for _, op in ipairs(T.ops) do
        if op.collection == name then
          pieces[#pieces + 1] = { _id = T._id, mark = T.mark, ops = { op } }
        end
      end
    end
    by_document(pieces, piece_op)
    local res, err = eng:many("finish", eng:coll(name), pieces, name)
    if not res then return nil, err end
    if next(res.items) ~= nil then
      for _, T in ipairs(list) do
        for _, op in ipairs(T.ops) do
          if op.collection == name then alone[T] = true end
        end
      end
    end
  end
  local ids, together = {}, {}
  for _, T in ipairs(list) do
    if not alone[T] then together[#together + 1], ids[#ids + 1] = T, T._id end
  end
  -- mine[id key]: moved to done by this call.  When another caller moved
  -- some first (a deferred finish and recovery, say), the stamp says
  -- which: each done event fires once, from whoever moved it (metrics)
  local mine
  if #ids > 0 then
    local by = core.ObjectId()
    local res, err = eng:many("done", eng.tx, ids, by)
    if not res then return nil, err end
    if res.moved < #ids then
      local docs
      docs, err = eng.tx:find_all({ _id = { ["$in"] = ids }, doneBy = by },
        { projection = { _id = 1 }, limit = #ids })
      if not docs then return nil, errors.wrap(err, "done") end
      mine = {}
      for _, d in ipairs(docs) do mine[id_key(d._id)] = true end
    end
  end
  local loud = eng:listening()
  for _, T in ipairs(together) do
    T.state, T.parked = "done", nil -- (done unsets parked: csrc/txn_state.c)
    if loud and (not mine or mine[id_key(T._id)]) then
      eng:event_id("finish", T._id)
      eng:event_id("done", T._id)
    end
  end
  local n, first = #together, nil
  for _, T in ipairs(list) do
    if alone[T] then
      local now, err = eng:finish(T)
      if now and now.state == "done" then
        T.state, T.parked, n = "done", nil, n + 1
      else
        first = first or err or errors.new("state", "the transaction did not finish",
          { step = "finish", id = T._id })
      end
    end
  end
  return n, first
end

-- The entries still on the fast way (those created only, with `created`),
-- and their versions.
local function live(entries, versions, created)
  local out, vs = {}, {}
  for t, e in ipairs(entries) do
    if not e.err and not e.slow and (not created or e.created) then
      local n = #out + 1
      out[n] = e
      if versions then vs[n] = versions[t] end
    end
  end
  return out, versions and vs
end

-- Runs specs[i] = { ops = <validated ops>, stored = <as stored, when
-- validate.ops made it>, id =, meta =, extra = <fields
-- of the transaction document> } as one batch up to the commit point.
-- Returns results, errs, committed: results[i] the transaction (state
-- `applied`, or `done` when it went the one-at-a-time way) or false,
-- errs[i] why not (a policy that raised while one was settled: the
-- raise, code "policy"; errors.is_policy tells it), the committed
-- transactions left to finish (the
-- caller finishes them at once or later: policy.finish), late[i] =
-- true for those settled one at a time after the others had committed
-- (their effects, and what their guards read, come after the others':
-- mongotx.group reports that order), and held[i] = <the transaction as
-- read> for those another call holds within its lease: not waited for
-- (errs[i] is `in_progress`; mongotx.manager.batches waits for them all
-- at once after the others finished, mongotx.group has their callers
-- wait).  With `hand` (mongotx.group), one whose apply must wait for a
-- retry is not waited for either: busy[i] = <what its caller needs to go
-- on with it> (settle.handed), results[i] and errs[i] false.
function _M.run(eng, specs, hand)
  local entries, results, errs = {}, {}, {}
  local now, err = eng:clock()
  local deadline, stamp
  if now then
    stamp = eng:stamp(now)
    if eng:deadlines() then deadline = core.Date(floor(now + eng.policy.lease * 1000)) end
  end
  local common = { state = "pending", epoch = 1, attempts = 1, application = eng.application,
                   instance = eng.instance, lease = eng.policy.lease, deadline = deadline,
                   lastModified = stamp, markerField = eng.marker,
                   versionField = eng.version_field }
  local coll = eng.vctx.collection
  for i, spec in ipairs(specs) do
    local id = spec.id
    if id == nil then id = core.ObjectId() end
    local T = { _id = id, state = "pending", ops = spec.ops, epoch = 1, attempts = 1,
                application = eng.application, instance = eng.instance,
                lease = eng.policy.lease, deadline = deadline, meta = spec.meta,
                lastModified = stamp, markerField = eng.marker,
                versionField = eng.version_field, mark = stored.new_mark(coll, id) }
    local doc = { _id = id, ops = spec.stored or stored.ops(spec.ops), meta = spec.meta,
                  mark = T.mark }
    local extra = spec.extra
    if extra then
      for k, v in pairs(extra) do T[k], doc[k] = v, v end
    end
    -- every field an entry may get, so that none makes its table grow
    entries[i] = { T = T, doc = doc, err = not now and err or nil, slow = false,
                   created = false, applied = false, sent = false, key = false,
                   later = hand and "hand" or true, held = false, busy = false }
  end
  local versions
  if now and not deadline then
    -- read before the create, which is this manager's claim
    local list = {}
    for i, e in ipairs(entries) do list[i] = e.T end
    versions, err = eng:versions_many(list)
    if not versions then
      for _, e in ipairs(entries) do fail(e, err) end
    end
  end
  local todo = live(entries, versions)
  if #todo > 0 then create(eng, todo, common) end
  local created, vs = live(entries, versions, true)
  for _, e in ipairs(created) do e.key = eng:hold(e.T._id, 1) end
  if #created > 0 then apply(eng, created, deadline, vs) end
  local ready = live(entries, versions)
  if #ready > 0 then commit(eng, ready) end
  local late = {}
  for t, e in ipairs(entries) do
    if e.slow and not e.err then late[t] = true end
  end
  settling.settle_all(eng, entries, deadline, versions, nil, hand)
  local committed, held, busy = {}, {}, {}
  for i, e in ipairs(entries) do
    results[i], errs[i], held[i] = not e.err and not e.busy and e.T, e.err or false, e.held or nil
    if e.busy then
      busy[i] = settling.handed(e, deadline, versions and versions[i])
    elseif not e.err and e.T.state == "applied" then
      committed[#committed + 1] = e.T
    end
  end
  return results, errs, committed, late, held, busy
end

-- Batched recovery and the grouped tm:commit (mongotx.engine.forward)
-- drive the transactions they claimed pending with the same apply, and
-- settle the ones left behind the same way, each step of one entry
-- guarded: entries { T, err, slow } as above.
_M.apply, _M.settle_all, _M.fail, _M.guarded, _M.raised_in = apply, settling.settle_all, fail, guarded,
  raised_in
-- mongotx.holds opens a batch of holds with the same create
_M.create, _M.inserted_here = create, settling.inserted_here

return _M
