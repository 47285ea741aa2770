-- mongotx.engine.forward: existing transactions driven forward as one
-- batch, one round trip per step for them all.  Batched recovery
-- (mongotx.recovery) and the grouped tm:commit (mongotx.group) share it:
--
--   claim    the versions of the documents (one find per collection) of
--            the pending ones, and of the initial ones where the server
--            cannot fence by deadline, then every claim in one bulk write
--            (Engine:claim_many), each fenced as a single one is;
--   forward  the claimed pending ones applied as a batch (mongotx.batch:
--            guarded ops first), committed in one round trip (an update per epoch);
--            those left behind settle alone, together (batch.settle_all:
--            one wait for those that wait), a policy's raise failing its
--            own entry only;
--   commit   (the grouped tm:commit) begun transactions: load in one find,
--            claim, forward, then finish and done (batch.finish).
--
-- Entries are mongotx.batch's: { T, err, slow, applied, ... }.  Fencing
-- is a single claim's: a claimed initial transaction was never pending,
-- so no former owner can apply its ops, and its own applies are fenced by
-- the deadline the claim set (as a batch's create is: mongotx.batch);
-- without deadlines, by the versions read before the claim.

local batch = require "mongotx.batch"
local settle = require "mongotx.batch.settle"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"

local ipairs, pairs = ipairs, pairs
local guarded, tid_key, live = batch.guarded, validate.tid_key, stored.live

local _M = {}

local function fail(e, err) e.err = e.err or err end

-- Versions that fence nothing but the deadline: T's ops as read by none.
local function unread(T)
  local vs = {}
  for i in ipairs(T.ops) do vs[i] = { marked = false, version = false } end
  return vs
end

-- Claims the entries (each T as read: initial, pending, applied or
-- canceling) in one bulk write, initial ones to pending; `now` is the
-- server's time read before (a pending one's deadline must have passed
-- it).  Returns, per entry, the claimed transaction or false (somebody
-- else moved it first), the versions of the initial and pending ones, and
-- the deadline the claims set; or nil, err (nothing claimed, or claims
-- whose leases expire unused).
function _M.claim(eng, entries, now)
  local fenced = eng:deadlines()
  local read, at = {}, {}
  for i, e in ipairs(entries) do
    local state = e.T.state
    if state == "pending" or (state == "initial" and not fenced) then
      local n = #read + 1
      read[n], at[n] = e.T, i
    end
  end
  local vs, err = {}, nil
  if #read > 0 then vs, err = eng:versions_many(read) end
  if not vs then return nil, err end
  -- the deadline from now: read after the versions, before the claim
  local deadline
  deadline, err = eng:new_deadline()
  if err then return nil, err end
  local list, versions = {}, {}
  for i, e in ipairs(entries) do
    list[i] = { T = e.T, set = e.T.state == "initial" and { state = "pending" } or nil }
    if e.T.state == "initial" and fenced then versions[i] = unread(e.T) end
  end
  for k, i in ipairs(at) do versions[i] = vs[k] end
  local claimed
  claimed, err = eng:claim_many(list, now, deadline)
  if not claimed then return nil, err end
  return claimed, versions, deadline
end

-- pending -> applied for the entries still on the batch's way, in one
-- round trip, each at its own epoch (claims moved them on from where each
-- was: an update per epoch); when not all moved, each goes on one at a
-- time (batch.settle_all looks).
local function commit(eng, entries)
  local list, ids, epochs = {}, {}, {}
  for _, e in ipairs(entries) do
    if not e.err and not e.slow then
      list[#list + 1], ids[#ids + 1], epochs[#epochs + 1] = e, e.T._id, e.T.epoch
    end
  end
  if #ids == 0 then return end
  local res, err = eng:many("commit", eng.tx, ids, epochs)
  for _, e in ipairs(list) do
    if not res then
      fail(e, err)
    elseif res.moved == #ids then
      e.T.state = "applied"
      eng:hold(e.T._id, nil) -- past the commit point: nothing to fence
      eng:event("commit", { id = e.T._id })
    else
      e.slow = "commit"
    end
  end
end

-- The claimed pending entries (versions[t]: entry t's, as claim returns
-- them): apply, commit; those left behind alone (batch.settle_all), a
-- policy's raise failing its entry only.  The committed ones are left
-- `applied` for finish; the others are `done` (settled alone) or carry
-- their error.
function _M.forward(eng, entries, versions, deadline, hand)
  batch.apply(eng, entries, deadline, versions)
  commit(eng, entries)
  batch.settle_all(eng, entries, deadline, versions, nil, hand)
end

-- Entry e driven on alone from where it stands now (read again), as
-- Engine:drive drives it: e.T the final transaction, or e.err.
function _M.again(eng, e)
  local T, err = eng:get(e.T._id)
  local held, busy
  if T then T, err, held, busy = eng:drive(T, nil, e.later) end
  if held then e.held = held end
  if busy then return settle.handing(e, busy) end
  if T then e.T = T else fail(e, err or errors.new("state", "no such transaction", { id = e.T._id })) end
end

-- The grouped tm:commit ----------------------------------------------------

-- Loads the transactions with these ids (as validate.check_tid sends
-- them) in one bounded find.  Returns found[tid_key(id)] = { T = <live>,
-- ready = <a batch may drive it: initial, this manager's form,
-- well-formed> }, or nil, err.
function _M.load(eng, ids)
  -- (a reply of one more than the limit: FerretDB v1 closes the cursor
  -- in it, where a reply of exactly the limit costs a killCursors more)
  local docs, err = eng.tx:find_all({ _id = { ["$in"] = ids } },
    { limit = #ids, batch_size = #ids + 1, sort = { _id = 1 } })
  if not docs then return nil, errors.wrap(err, "commit") end
  local found = {}
  for _, doc in ipairs(docs) do
    local ready = doc.state == "initial" and not validate.malformed(doc, eng.vctx)
    live(doc)
    found[tid_key(doc._id)] = { T = doc, ready = ready and eng:form(doc) == eng.own }
  end
  return found
end

local function drive(eng, e)
  local T, err, held, busy = eng:drive(e.T, nil, e.later)
  if held then e.held = held end
  if busy then return settle.handing(e, busy) end
  if T then e.T = T else fail(e, err) end
end

-- Commits the loaded transactions (items of load's found, distinct) as
-- one batch, each answered as Engine:drive answers it alone: the ready
-- ones claimed, forwarded and finished together; the others (any other
-- state or form, a lost claim) driven alone after them.  Returns results
-- (the transaction, `done`, or false), errs (its error or false),
-- late[i] = true for those settled one at a time after the others, and
-- held[i] = <the transaction as read> for those another owner holds
-- within its lease: not waited for, `in_progress` (Engine:drive's
-- `later`; mongotx.group has their callers wait).  With `hand`, one
-- whose apply must wait for a retry is not waited for either: busy[i]
-- says how its caller goes on with it (settle.handed; its `after` as
-- indices of items).
function _M.commit(eng, items, hand)
  local entries, ready, vs = {}, {}, {}
  for i, item in ipairs(items) do
    local e = { T = item.T, err = false, slow = false, applied = false, sent = false, key = false,
                later = hand and "hand" or true, held = false, busy = false }
    entries[i] = e
    if item.ready then ready[#ready + 1] = e end
  end
  local claimed, versions, deadline
  if #ready > 0 then claimed, versions, deadline = _M.claim(eng, ready) end
  local won = {}
  for k, e in ipairs(ready) do
    if not claimed then
      fail(e, versions)
    elseif claimed[k] then
      e.T = claimed[k]
      local n = #won + 1
      won[n], vs[n] = e, versions[k]
    else
      e.lost = true
    end
  end
  if #won > 0 then _M.forward(eng, won, vs, deadline, hand) end
  local finish, list = {}, {}
  for _, e in ipairs(won) do
    if not e.err and e.T.state == "applied" then
      local n = #list + 1
      finish[n], list[n] = e, e.T
    end
  end
  if #list > 0 then
    local _, err = batch.finish(eng, list)
    for _, e in ipairs(finish) do
      if e.T.state == "done" then eng:hold(e.T._id, nil) else fail(e, err) end
    end
  end
  local results, errs, late, held, busy, pos = {}, {}, {}, {}, {}, {}
  for k, e in ipairs(won) do pos[e] = k end
  for i, e in ipairs(entries) do
    if e.lost then
      guarded(_M.again, eng, e) -- as drive goes on after a claim it lost
    elseif not items[i].ready then
      guarded(drive, eng, e)
    end
    late[i] = e.lost or e.slow or not items[i].ready or nil
    if e.busy then
      eng:hold(e.T._id, nil)
      busy[i] = settle.handed(e, deadline, vs[pos[e]])
    elseif not e.err and e.T.state ~= "done" then
      fail(e, errors.new("state", "the transaction did not settle", { id = e.T._id }))
    end
    results[i], errs[i], held[i] = not e.err and not e.busy and e.T, e.err or false, e.held or nil
  end
  -- their `after`: indices of won (settle_all's list) as indices of items
  local item = {}
  for i, e in ipairs(entries) do
    if pos[e] then item[pos[e]] = i end
  end
  for _, b in pairs(busy) do
    for n, k in ipairs(b.after) do b.after[n] = item[k] end
  end
  return results, errs, late, held, busy
end

return _M
