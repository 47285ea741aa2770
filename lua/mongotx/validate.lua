-- Checks and normalises what callers pass in, before anything is written
-- (DESIGN.md §8).  Wrong argument types are programming errors and raise;
-- bad content returns nil and an `invalid` error saying which op and why.
-- Caller data never becomes a query operator: ids and inserted documents
-- may not hold `$` keys (nor dotted keys, which servers read as paths),
-- and the fields mongotx owns are off limits.  Options are checked in
-- mongotx.options (validate.options forwards there).
--
-- The checks themselves are C (csrc/checks.c: core.check_ops and the
-- core.check_* below): in Lua they were more than half the client CPU of
-- a batched transfer.  Only a `where`'s filter grammar is Lua, called
-- back from there.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local stored = require "mongotx.stored"

local type, pairs, ipairs, tostring = type, pairs, ipairs, tostring
local sort, concat, format = table.sort, table.concat, string.format
local huge = math.huge

local _M = {}

local math_type = math.type
local function is_integer(n)
  if math_type then return math_type(n) == "integer" end
  return n == math.floor(n) and n > -2 ^ 53 and n < 2 ^ 53
end

-- A string that is the same for equal BSON values whatever the order of
-- the table's keys: used to compare op lists across processes (is a
-- repeated begin the same transaction?).  Ids are compared by
-- check_id's key instead, in the server's terms.
local function canon(v)
  local t = type(v)
  if t == "number" then
    if is_integer(v) then return format("i%d", v) end
    return format("n%.17g", v)
  elseif t == "string" then
    return format("s%d:%s", #v, v)
  elseif t == "boolean" or t == "nil" then
    return tostring(v)
  elseif t == "table" then
    local kind = core.type(v)
    local parts = {}
    if kind == "array" then
      for i = 1, #v do parts[i] = canon(v[i]) end
      return "[" .. concat(parts, ",") .. "]"
    end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    sort(keys)
    for i, k in ipairs(keys) do parts[i] = canon(k) .. "=" .. canon(v[k]) end
    return "{" .. concat(parts, ",") .. "}"
  end
  return (core.type(v) or t) .. ":" .. tostring(v)
end
_M.canon = canon

local function invalid(message, i)
  if i then message = "op " .. i .. ": " .. message end
  return nil, errors.new("invalid", message, { step = "begin" })
end

-- Checks read raw contents (next, rawget, rawlen), as the encoder does:
-- a metatable's __pairs, __index or __len cannot show them anything else
-- than what would be sent.  Values that go into filters or documents are
-- then snapshotted through the encoder (snapshot below) and the checks
-- run on the copy, which is what is sent.
-- (LuaJIT has no rawlen, and its # ignores __len: the same thing.)
local next, rawlen = next, rawlen or function(t) return #t end
_M.rawlen = rawlen

-- v as it would be sent: encoded and decoded again, so that later checks
-- and every write see the same plain tables; nil and why when v cannot be
-- encoded (a function, a table holding itself, over 16 MiB, ...).  For a
-- table, also the BSON of the copy as a document, which is how the
-- transaction stores it (stored.ops): each op is encoded once.
local encode, core_snapshot = core.encode, core.snapshot
local function snapshot(v)
  if type(v) ~= "table" then return v end
  local ok, copy, bytes = pcall(core_snapshot, v)
  if not ok then return nil, (tostring(copy):gsub("^mongotx: ", "")) end
  return copy, bytes
end
_M.snapshot = snapshot

local function finite(x)
  return x == x and x ~= huge and x ~= -huge
end

-- A caller's value to be stored in a document (a job's details or
-- result, ...): its snapshot (as the server will hold it), or nil and
-- why: it cannot be encoded, or holds a `$` key, a dotted key (servers
-- read both as operators or paths) or a NaN or infinite number.
local check_value = core.check_value
function _M.value(v)
  local snap, why = snapshot(v)
  if type(v) ~= "table" and not pcall(encode, { v = v }) then
    snap, why = nil, "a " .. type(v) .. " is no BSON value"
  end
  if snap == nil and v ~= nil then return nil, "it cannot be stored: " .. why end
  why = check_value(snap)
  if why then return nil, why end
  return snap
end

-- A document or update `module` (mongotx.<module>) is about to send for
-- `step`, made of a caller's value (`what`: "the document", "the update",
-- ...) and the fields the module adds (versions, flags, a job's fields):
-- true when it encodes
-- within 16 MiB (what the encoder, and the server, take), else nil and an
-- `invalid` error naming `what`, so that nothing is written.  An update is
-- checked as the statement the server reads, { q = filter, u = update }:
-- servers differ on how far past 16 MiB they take one (mongo-java-server
-- drops the connection a few bytes short of it).  Only what is sent is
-- checked: an update that makes a stored document grow past 16 MiB is
-- the server's error.
function _M.fits(doc, what, module, step, id)
  local ok, why = pcall(encode, doc)
  if ok then return true end
  return nil, errors.new("invalid", format("%s cannot be stored: with the fields mongotx.%s " ..
    "adds it takes more than 16 MiB (%s)", what, module, (tostring(why):gsub("^mongotx: ", ""))),
    { step = step, id = id })
end

local check_update, operator_key, touched = core.check_update, core.operator_key, core.touched

-- Checks an id (a transaction's, or an op's document) for use in a
-- filter: it must match exactly one value there (core.id_key says which
-- types may, ids.c).  Returns the id as it will be sent and its key
-- (equal for ids the server takes for one _id: 1, 1.0, Int64(1)), or nil,
-- err.
local core_check_id = core.check_id
local function check_id(id, i)
  local sent, key = core_check_id(id)
  if sent == nil then return invalid(key, i) end
  return sent, key
end
_M.check_id = check_id

-- check_id for a transaction's id, which must also be a scalar: it goes
-- into marker arrays, and `$pull` reads a document value as a condition
-- (pulling {a = 1} would pull another transaction's {a = 1, b = 2} too).
function _M.check_tid(id)
  local sent, key = check_id(id)
  if sent == nil then return nil, key end
  if core.type(sent) == "object" then
    return invalid("a transaction id may not be a document (it goes into marker " ..
      "arrays, where $pull reads a document as a condition)")
  end
  if type(sent) == "string" and sent:sub(1, #stored.MARK_PREFIX) == stored.MARK_PREFIX then
    return invalid(string.format("a transaction id may not start with %q " ..
      "(mongotx's marks: docs/guards.md, \"Data model\")", stored.MARK_PREFIX))
  end
  return sent, key
end

_M.id_key = stored.id_key

-- A transaction id as a table key: equal for ids the server takes for
-- one (1 and 1.0).
function _M.tid_key(id) return stored.id_key(id) or canon(id) end

-- The query operators a `where` may use.  Anything else is refused at
-- begin: an unknown operator would fail every apply until the
-- transaction is parked, and $where, $expr, $function, $text, $jsonSchema
-- or geo operators are code, or more than a guard on one document needs.
local query_operators = {
  ["$eq"] = true, ["$ne"] = true, ["$gt"] = true, ["$gte"] = true, ["$lt"] = true,
  ["$lte"] = true, ["$in"] = true, ["$nin"] = true, ["$exists"] = true, ["$type"] = true,
  ["$mod"] = true, ["$regex"] = true, ["$options"] = true, ["$all"] = true,
  ["$elemMatch"] = true, ["$size"] = true, ["$not"] = true, ["$bitsAllSet"] = true,
  ["$bitsAnySet"] = true, ["$bitsAllClear"] = true, ["$bitsAnyClear"] = true,
}
local logical_operators = { ["$and"] = true, ["$or"] = true, ["$nor"] = true }

local check_filter

-- The kinds of argument the server takes for each operator of a field's
-- expression (other operators, such as $eq or $gt, take any value).
local function is_number(x) return type(x) == "number" or core.type(x) == "long" end
local function numbers_or_list(x)
  if is_number(x) or core.type(x) == "binData" then return true end
  if core.type(x) ~= "array" then return false end
  for _, n in ipairs(x) do if not is_number(n) then return false end end
  return true
end
local argument_checks = {
  ["$in"] = function(x) return core.type(x) == "array" end,
  ["$nin"] = function(x) return core.type(x) == "array" end,
  ["$all"] = function(x) return core.type(x) == "array" end,
  ["$size"] = function(x) return is_number(x) and x >= 0 and x == math.floor(x) end,
  ["$mod"] = function(x)
    return core.type(x) == "array" and #x == 2 and is_number(x[1]) and is_number(x[2])
  end,
  ["$exists"] = function(x) return type(x) == "boolean" or is_number(x) end,
  ["$type"] = function(x)
    if type(x) == "string" or is_number(x) then return true end
    if core.type(x) ~= "array" or #x == 0 then return false end
    for _, y in ipairs(x) do
      if type(y) ~= "string" and not is_number(y) then return false end
    end
    return true
  end,
  ["$regex"] = function(x) return type(x) == "string" or core.type(x) == "regex" end,
  ["$options"] = function(x) return type(x) == "string" end,
  ["$bitsAllSet"] = numbers_or_list, ["$bitsAnySet"] = numbers_or_list,
  ["$bitsAllClear"] = numbers_or_list, ["$bitsAnyClear"] = numbers_or_list,
}

-- Does the document v have a key that starts with `$`?
local function has_operator(v)
  for k in pairs(v) do
    if type(k) == "string" and k:sub(1, 1) == "$" then return true end
  end
  return false
end

-- The expression a field of a where is compared with: a value (no `$`
-- key anywhere in it), or a document of operators, each in its place
-- with an argument of the kind the server takes (an operator elsewhere
-- would fail every apply until the transaction is parked).
local function check_condition(cond, i, depth)
  if depth > 100 then return invalid("where nests too deep", i) end
  if core.type(cond) ~= "object" or not has_operator(cond) then
    local op = operator_key(cond, 0)
    if op then return invalid(format("where may not use %s inside a value", op), i) end
    return true
  end
  for op, arg in pairs(cond) do
    if type(op) ~= "string" or op:sub(1, 1) ~= "$" then
      return invalid(format("where mixes operators and the field %s in one condition",
        tostring(op)), i)
    end
    if not query_operators[op] then
      return invalid(format("where may not use %s (not a query operator mongotx " ..
        "accepts for a guard)", op), i)
    end
    local check = argument_checks[op]
    if check and not check(arg) then
      return invalid(format("where: %s does not take %s", op, core.type(arg) or type(arg)), i)
    end
    local ok, err = true, nil
    if op == "$not" then
      if core.type(arg) ~= "regex" then
        if core.type(arg) ~= "object" or not has_operator(arg) then
          return invalid("where: $not takes a regex or operators", i)
        end
        ok, err = check_condition(arg, i, depth + 1)
      end
    elseif op == "$elemMatch" then
      if core.type(arg) ~= "object" then return invalid("where: $elemMatch takes a document", i) end
      if has_operator(arg) and not (next(arg) and (logical_operators[next(arg)])) then
        ok, err = check_condition(arg, i, depth + 1)
      else
        ok, err = check_filter(arg, nil, i, depth + 1) -- a filter on the elements
      end
    elseif op == "$in" or op == "$nin" or op == "$all" or (op ~= "$regex" and op ~= "$options"
        and not check) then
      local bad = operator_key(arg, 0)
      if bad then return invalid(format("where may not use %s inside a value", bad), i) end
    end
    if not ok then return nil, err end
  end
  if cond["$options"] ~= nil and cond["$regex"] == nil then
    return invalid("where: $options needs a $regex beside it", i)
  end
  return true
end

-- A filter document of a where (the top level, a branch of $and, $or,
-- $nor, or an $elemMatch on a list of documents): field names and
-- logical operators; at the top level (owned given) the field names may
-- not reach _id or the fields mongotx owns.
function check_filter(where, owned, i, depth)
  if core.type(where) ~= "object" then return invalid("where must be a document", i) end
  if depth > 100 then return invalid("where nests too deep", i) end
  for k, x in pairs(where) do
    if type(k) ~= "string" then return invalid("where keys are strings", i) end
    if logical_operators[k] then
      if core.type(x) ~= "array" or #x == 0 then
        return invalid(format("where: %s needs a list of conditions", k), i)
      end
      for _, branch in ipairs(x) do
        local ok, err = check_filter(branch, owned, i, depth + 1)
        if not ok then return nil, err end
      end
    elseif k:sub(1, 1) == "$" then
      return invalid(format("where may not use %s", k), i)
    else
      -- (a part after a dot starting with $ is no field: the server
      -- refuses it, or takes it as an operator, once the transaction is
      -- stored)
      if k == "" or k:sub(1, 1) == "." or k:sub(-1) == "." or k:find("..", 1, true)
          or k:find(".$", 1, true) then
        return invalid(format("where has a bad field name %q", k), i)
      end
      if owned and (k == "_id" or k:sub(1, 4) == "_id.") then
        return invalid("where may not constrain _id", i)
      end
      local field = owned and touched(k, owned)
      if field then return invalid("where may not constrain " .. field, i) end
      local ok, err = check_condition(x, i, depth + 1)
      if not ok then return nil, err end
    end
  end
  return true
end

-- where: a snapshot (plain tables as sent).
local function check_where(where, owned, i)
  if where == nil then return true end
  if type(where) ~= "table" then return invalid("where must be a table", i) end
  return check_filter(where, owned, i, 0)
end

-- A filter of tm:find: what a where may hold (the guards' operators,
-- each with an argument of the kind the server takes), on any field.
-- Its snapshot (what is checked is what is sent), or nil and an
-- `invalid` error.
function _M.filter(filter)
  local copy, why = snapshot(filter)
  if copy == nil then return nil, errors.new("invalid", "filter: " .. why, { step = "find" }) end
  local ok, err = check_filter(copy, nil, nil, 0)
  if not ok then
    err.step, err.message = "find", "filter: " .. err.message:gsub("^where:? ?", "")
    return nil, err
  end
  return copy
end

-- For core.check_ops (csrc/checks.c), which calls back for an op's
-- where (a snapshot): true and whether it is a floor guard, or nil, err.
local function check_op_where(where, owned, i)
  local ok, err = check_where(where, owned, i)
  if not ok then return nil, err end
  return true, stored.is_floor(where) or nil
end

-- What a transaction's ops may take of its 16 MiB document, leaving the
-- rest to its state, owner, meta and the like.
local MAX_OPS_BYTES = 16 * 1024 * 1024 - 64 * 1024

-- ops: the caller's op list; ctx: { collection = transactions collection
-- name, owned = { "_id", marker, version }, name_max = the most bytes of
-- an op's collection name (nil: no limit), escrow = credits are escrowed
-- (docs/guards.md) }.  Returns the normalised
-- list and the ops as the transaction stores them (stored.ops), or nil,
-- err.  The list and its ops are read raw.  `built`: the ops are
-- mongotx's own, made from checked scalars (nothing to snapshot).
local check_ops = core.check_ops
function _M.ops(ops, ctx, built)
  if type(ops) ~= "table" then error("ops must be a table", 3) end
  local out, stored_ops, size = check_ops(ops, ctx.collection, ctx.owned, built, check_op_where,
    ctx.name_max, ctx.escrow)
  if not out then
    if type(stored_ops) == "string" then return invalid(stored_ops, size) end
    return nil, stored_ops -- the where's check made it
  end
  -- Too big for one document is bad content, found here rather than as a
  -- raise from the insert: the stored form (update, undo and where as
  -- BSON in binaries) measured, and room left for the transaction's own
  -- fields.  That form is what the transaction document holds.
  if size > MAX_OPS_BYTES then
    return invalid(format("the ops take %d bytes: a transaction is one document of " ..
      "at most 16 MiB", size))
  end
  return out, stored_ops
end

-- For the modules beside the transactions (mongotx.sync,
-- mongotx.versioned): a caller's update checked as an op's would be and
-- snapshotted (what is sent), or a caller's id checked by check_id; nil
-- and an `invalid` error of that module's call `step` when bad.
-- `owned`: the fields the module keeps, which an update may not touch.
local function as_step(step, v, err)
  if v == nil then err.step = step end
  return v, err
end

function _M.update(u, owned, step)
  local sent, why = snapshot(u)
  if sent == nil then return as_step(step, invalid("update cannot be stored: " .. why)) end
  local ok, why2 = check_update(sent, owned, "update")
  if not ok then return as_step(step, invalid(why2)) end
  return sent
end

function _M.module_id(id, step)
  return as_step(step, check_id(id))
end

-- The options of the public calls live in mongotx.options; this name
-- stays for the callers that use it: opts, or nil and an `invalid` error.
_M.options = require("mongotx.options").check

-- Stored transactions ------------------------------------------------------

local states = { initial = true, pending = true, applied = true, done = true,
                 canceling = true, cancelled = true }

-- An op's update, undo or where as stored: a binary holding BSON (what
-- begin writes) or a document; the table, or nil and what is wrong.
local function stored_doc(v, name)
  if core.type(v) == "binData" then
    local doc, err = core.decode((v:value()))
    if not doc then return nil, name .. " is not BSON (" .. tostring(err) .. ")" end
    return doc
  end
  if core.type(v) ~= "object" then return nil, name .. " is not a document" end
  return v
end

local function malformed_op(op, ctx)
  if core.type(op) ~= "object" then return "not a document" end
  local ok, bad = core.check_collection(op.collection, ctx.collection)
  if not ok then return bad end
  local id
  id, bad = core_check_id(op.id)
  if id == nil then return bad end
  if type(op.kind) ~= "string" or not core.op_kinds[op.kind] then
    return "unknown kind " .. tostring(op.kind)
  end
  local parts = {}
  for _, f in ipairs { "update", "undo", "where" } do
    if op[f] ~= nil then
      local why
      parts[f], why = stored_doc(op[f], f)
      if not parts[f] then return why end
    end
  end
  if op.kind == "update" then
    ok, bad = check_update(parts.update, ctx.owned, "update")
    if not ok then return bad end
    ok, bad = check_update(parts.undo, ctx.owned, "undo")
    if not ok then return bad end
  end
  if op.kind == "insert" and core.type(op.doc) ~= "object" then
    return "insert without a doc"
  end
  if op.effect == "escrow" then
    -- what the finish moves out of txPending is read from the update, and
    -- the undo's negative numbers take it back: both $inc of numbers only
    if op.kind ~= "update" or not core.escrowable(parts.update) or next(parts.undo) ~= "$inc"
        or next(parts.undo, "$inc") ~= nil then
      return "an escrowed op whose update or undo is not an $inc of numbers"
    end
  elseif op.effect ~= nil and op.effect ~= "lowers" then
    return "unknown effect " .. tostring(op.effect)
  end
  if op.settle ~= nil then
    -- (required here: mongotx.holds requires this module)
    local why = require("mongotx.holds").settle_error(op, parts.update)
    if why then return why end
  end
  local _, err = check_where(parts.where, ctx.owned)
  if err then return err.message end
end

-- What is wrong with a transaction document read back from the database,
-- or nil when the steps can drive it.  Recovery skips (and reports) such
-- documents rather than let one raise in the middle of a pass, or turn a
-- hand-edited op into a write the caller never asked for.  ctx as for
-- ops().  Reads T only: update, undo and where stay as stored.
function _M.malformed(T, ctx)
  if type(T.state) ~= "string" or not states[T.state] then
    return "state is not a state name: " .. (core.type(T.state) or type(T.state))
  end
  if T.ops == nil then -- (stored.OWN: recovery and the counts never read such a one)
    return "no ops: another writer's document (foreign), which mongotx leaves alone"
  end
  if core.type(T.ops) ~= "array" or #T.ops == 0 then
    return "ops is not a list of ops: " .. (core.type(T.ops) or type(T.ops))
  end
  for i, op in ipairs(T.ops) do
    local why = malformed_op(op, ctx)
    if why then return format("op %d: %s", i, why) end
  end
  if T.lastModified ~= nil and core.type(T.lastModified) ~= "date" then
    return "lastModified is not a date: " .. core.type(T.lastModified)
  end
  for _, f in ipairs { "epoch", "attempts", "lease" } do
    if T[f] ~= nil and type(T[f]) ~= "number" then
      return f .. " is not a number: " .. (core.type(T[f]) or type(T[f]))
    end
  end
  return _M.fields_error(T, ctx.collection)
end

-- Why the marker and version fields and the mark T records
-- (mongotx.stored) are not fit to drive it with, or nil; with `coll` (T's
-- collection), a mark must be the one T's collection and _id make.
function _M.fields_error(T, coll)
  local field_ok = require("mongotx.options").field_ok
  for _, f in ipairs { "markerField", "versionField" } do
    local v = T[f]
    if v ~= nil and not (type(v) == "string" and field_ok(v)) then
      return f .. " is not a field name mongotx may write"
    end
  end
  if T.markerField ~= nil and T.markerField == T.versionField then
    return "markerField and versionField are one field"
  end
  if T.mark ~= nil then
    -- (ids compared as the server does: the one read back may be encoded
    -- otherwise than the one the mark was made of, Int64(1) as 1)
    local named, id = stored.named(T.mark)
    if named == nil or named == stored.HOME or stored.id_key(id) ~= stored.id_key(T._id)
        or (coll and named ~= coll) then
      return "mark is not this transaction's mark"
    end
  end
end

-- Amounts beyond 2^53 are not exact as doubles (LuaJIT, or a double
-- field), so their inverse would not restore the balance.
local MAX_AMOUNT = 2 ^ 53

-- A number used as a bound in a guard (transfer's `min`): finite, of any
-- sign, and within 2^53 where numbers stay exact.
function _M.bound(x, what)
  if type(x) ~= "number" then error(what .. " must be a number", 3) end
  if not finite(x) or x > MAX_AMOUNT or x < -MAX_AMOUNT then
    return invalid(format("%s must be a finite number within 2^53, not %.17g", what, x))
  end
  return true
end

function _M.amount(amount)
  if type(amount) ~= "number" then error("amount must be a number", 3) end
  if not finite(amount) then
    return invalid("amount must be finite, not " .. tostring(amount))
  end
  if amount <= 0 then return invalid("amount must be positive") end
  if amount > MAX_AMOUNT then
    return invalid(format("amount %.17g is beyond 2^53, where numbers stop being exact", amount))
  end
  return true
end

return _M
