-- mongotx.holds.views: what a hold is, as tm:get, `mongotx show` and
-- `mongotx list` say it (docs/holds.md): its status from its state, its
-- expiry and whether both its marks are on its documents (a pending hold
-- without them is still opening), read for one hold or, in bounded
-- reads, for a page of them.  mongotx.holds decides holds; this module
-- only reads.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"

local pairs, ipairs, type, pcall = pairs, ipairs, type, pcall

local _M = {}

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
function _M.opened(eng, T)
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
      open = _M.opened(eng, T)
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

return _M
