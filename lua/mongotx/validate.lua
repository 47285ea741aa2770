-- Checks and normalises what callers pass in, before anything is written
-- (DESIGN.md §8).  Wrong argument types are programming errors and raise;
-- bad content returns nil and an `invalid` error saying which op and why.
-- Caller data never becomes a query operator: ids and inserted documents
-- may not hold `$` keys (nor dotted keys, which servers read as paths),
-- and the fields mongotx owns are off limits.  Options are checked in
-- mongotx.options (validate.options forwards there).

local core = require "mongotx.core"
local errors = require "mongotx.errors"

local type, pairs, ipairs, tostring = type, pairs, ipairs, tostring
local sort, concat, format = table.sort, table.concat, string.format
local huge = math.huge

local _M = {}

local function is_integer(n)
  if math.type then return math.type(n) == "integer" end
  return n == math.floor(n) and n > -2 ^ 53 and n < 2 ^ 53
end

-- A string that is the same for equal BSON values whatever the order of
-- the table's keys: used to compare ids and ops across processes.  With
-- `numeric`, an integral float reads as the integer (1.0 as 1), as the
-- server compares numbers when it matches an _id.
local function canon(v, numeric)
  local t = type(v)
  if t == "number" then
    if is_integer(v) or (numeric and v == math.floor(v) and v > -2 ^ 63 and v < 2 ^ 63) then
      return format("i%d", v)
    end
    return format("n%.17g", v)
  elseif t == "string" then
    return format("s%d:%s", #v, v)
  elseif t == "boolean" or t == "nil" then
    return tostring(v)
  elseif t == "table" then
    local kind = core.type(v)
    local parts = {}
    if kind == "array" then
      for i = 1, #v do parts[i] = canon(v[i], numeric) end
      return "[" .. concat(parts, ",") .. "]"
    end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    sort(keys)
    for i, k in ipairs(keys) do parts[i] = canon(k) .. "=" .. canon(v[k], numeric) end
    return "{" .. concat(parts, ",") .. "}"
  end
  return (core.type(v) or t) .. ":" .. tostring(v)
end
_M.canon = canon

local function invalid(message, i)
  if i then message = "op " .. i .. ": " .. message end
  return nil, errors.new("invalid", message, { step = "begin" })
end

-- The first key starting with `$` anywhere in v, or nil.
local function operator_key(v, depth)
  if type(v) ~= "table" or depth > 100 then return nil end
  for k, x in pairs(v) do
    if type(k) == "string" and k:sub(1, 1) == "$" then return k end
    local found = operator_key(x, depth + 1)
    if found then return found end
  end
end

-- A plain table (not from core.doc or decoding) with several keys anywhere
-- in v: its keys would encode in whatever order pairs() gives.  Returns
-- its keys, or nil.
local function unordered_table(v, depth)
  if type(v) ~= "table" or depth > 100 then return nil end
  local mt = getmetatable(v)
  local keys = {}
  for k, x in pairs(v) do
    if type(k) == "string" then keys[#keys + 1] = k end
    local found = unordered_table(x, depth + 1)
    if found then return found end
  end
  if #keys > 1 and not (mt and mt.__mongotx) then
    sort(keys)
    return concat(keys, ", ")
  end
end

-- The first key holding a dot anywhere in v, or nil.
local function dotted_key(v, depth)
  if type(v) ~= "table" or depth > 100 then return nil end
  for k, x in pairs(v) do
    if type(k) == "string" and k:find(".", 1, true) then return k end
    local found = dotted_key(x, depth + 1)
    if found then return found end
  end
end

-- The first operator anywhere in v that runs JavaScript on the server, or
-- nil: a `where` is a filter, never code.
local code_operators = { ["$where"] = true, ["$function"] = true, ["$accumulator"] = true }
local function code_operator(v, depth)
  if type(v) ~= "table" or depth > 100 then return nil end
  for k, x in pairs(v) do
    if code_operators[k] then return k end
    local found = code_operator(x, depth + 1)
    if found then return found end
  end
end

local function finite(x)
  return x == x and x ~= huge and x ~= -huge
end

-- The first number in v that is NaN or infinite, or nil.
local function non_finite(v, depth)
  if type(v) == "number" then return not finite(v) and v or nil end
  if type(v) ~= "table" or depth > 100 then return nil end
  for _, x in pairs(v) do
    local bad = non_finite(x, depth + 1)
    if bad then return bad end
  end
end

local function touches(path, field)
  return path == field or path:sub(1, #field + 1) == field .. "."
      or field:sub(1, #path + 1) == path .. "."
end

local update_operators = {
  ["$inc"] = true, ["$set"] = true, ["$unset"] = true, ["$push"] = true,
  ["$pull"] = true, ["$addToSet"] = true, ["$pop"] = true, ["$min"] = true,
  ["$max"] = true, ["$mul"] = true, ["$rename"] = true,
  ["$currentDate"] = true, ["$pullAll"] = true, ["$bit"] = true,
}

-- Operators whose every value must be a number, and what counts as one.
local numeric_operators = { ["$inc"] = true, ["$mul"] = true }
local numeric_types = { int = true, long = true, double = true, decimal = true }

-- An update document: operators only, none touching _id or the fields
-- mongotx keeps on documents.
local function check_update(u, owned, what, i)
  if type(u) ~= "table" then return invalid(what .. " must be a table", i) end
  local n = 0
  for opname, fieldset in pairs(u) do
    n = n + 1
    if type(opname) ~= "string" or not update_operators[opname] then
      return invalid(format("%s: %s is not an update operator (an update " ..
        "needs operators such as $inc or $set)", what, tostring(opname)), i)
    end
    if type(fieldset) ~= "table" or next(fieldset) == nil then
      return invalid(format("%s: %s needs a table of fields", what, opname), i)
    end
    for path, value in pairs(fieldset) do
      if type(path) ~= "string" or path == "" or path:sub(1, 1) == "$"
          or (path .. "."):find("^%.") or (path .. "."):find("%.%.") then
        return invalid(format("%s: %s has a bad field name %s", what, opname,
          tostring(path)), i)
      end
      if numeric_operators[opname] then
        if not numeric_types[core.type(value)] then
          return invalid(format("%s: %s of %s needs a number, not %s", what, opname,
            path, core.type(value) or type(value)), i)
        end
        -- its inverse would be itself: -math.mininteger overflows
        if math.mininteger and value == math.mininteger then
          return invalid(format("%s: %s of %s by %d cannot be undone (its " ..
            "negation overflows)", what, opname, path, value), i)
        end
      end
      if opname == "$rename" and (type(value) ~= "string" or value == ""
          or value:sub(1, 1) == "$") then
        return invalid(format("%s: $rename of %s needs a field name", what, path), i)
      end
      for _, field in ipairs(owned) do
        if touches(path, field) or (opname == "$rename" and type(value) == "string"
            and touches(value, field)) then
          return invalid(format("%s: %s may not touch %s", what, opname, field), i)
        end
      end
    end
  end
  if n == 0 then return invalid(what .. " is empty", i) end
  local bad = non_finite(u, 0)
  if bad then return invalid(format("%s holds %s", what, tostring(bad)), i) end
  return true
end

-- The automatic undo of an update made only of $inc: the same $inc negated.
local function inverse_inc(u)
  for opname in pairs(u) do
    if opname ~= "$inc" then return nil end
  end
  local inc = {}
  for field, amount in pairs(u["$inc"]) do
    if type(amount) ~= "number" then return nil end
    inc[field] = -amount
  end
  return { ["$inc"] = inc }
end

local op_keys = { collection = true, id = true, kind = true, update = true,
                  doc = true, undo = true, where = true }
local kinds = { update = true, insert = true, remove = true, assert = true }

local function check_id(id, i)
  local t = type(id)
  if id == nil then return invalid("needs an id", i) end
  if t == "function" or t == "thread" then
    return invalid("id may not be a " .. t, i)
  end
  if t == "number" and not finite(id) then
    return invalid("id may not be " .. tostring(id), i)
  end
  local op = operator_key(id, 0)
  if op then
    return invalid(format("id holds the key %q: an id may not look like a " ..
      "query operator", op), i)
  end
  local unordered = unordered_table(id, 0)
  if unordered then
    return invalid(format("id holds a table with several keys (%s): the key order of " ..
      "an _id matters, so build it with mongotx.doc", unordered), i)
  end
  local dotted = dotted_key(id, 0)
  if dotted then
    return invalid(format("id holds the key %q: keys of an id may not hold dots", dotted), i)
  end
  return true
end
_M.check_id = check_id

local function check_collection(name, txcoll, i)
  if type(name) ~= "string" or name == "" then
    return invalid("needs a collection name", i)
  end
  if name:find("[%$%z]") or name:sub(1, 7) == "system." then
    return invalid(format("bad collection name %q", name), i)
  end
  if name == txcoll then
    return invalid("may not touch the transactions collection", i)
  end
  return true
end

local function check_where(where, owned, i)
  if where == nil then return true end
  if type(where) ~= "table" then return invalid("where must be a table", i) end
  for k in pairs(where) do
    if type(k) ~= "string" then return invalid("where keys are strings", i) end
    if k == "$where" then return invalid("where may not use $where", i) end
    if k == "" or k:sub(1, 1) == "." or k:sub(-1) == "." or k:find("..", 1, true) then
      return invalid(format("where has a bad field name %q", k), i)
    end
    if k == "_id" then return invalid("where may not constrain _id", i) end
    for _, field in ipairs(owned) do
      if touches(k, field) then
        return invalid("where may not constrain " .. field, i)
      end
    end
  end
  local code = code_operator(where, 0)
  if code then return invalid(format("where may not use %s (server-side code)", code), i) end
  return true
end

-- Checks one op and returns its normal form (kind set, undo filled in).
local function normalise_op(op, i, ctx)
  if type(op) ~= "table" then return invalid("must be a table", i) end
  for k in pairs(op) do
    if not op_keys[k] then return invalid("unknown key " .. tostring(k), i) end
  end
  local ok, err = check_collection(op.collection, ctx.collection, i)
  if not ok then return nil, err end
  ok, err = check_id(op.id, i)
  if not ok then return nil, err end
  local kind = op.kind or (op.doc ~= nil and "insert")
               or (op.update ~= nil and "update") or nil
  if not kinds[kind] then
    return invalid("kind must be update, insert, remove or assert", i)
  end
  ok, err = check_where(op.where, ctx.owned, i)
  if not ok then return nil, err end
  local out = { collection = op.collection, id = op.id, kind = kind,
                where = op.where }
  if kind == "update" then
    ok, err = check_update(op.update, ctx.owned, "update", i)
    if not ok then return nil, err end
    local undo = op.undo or inverse_inc(op.update)
    if undo == nil then
      return invalid("an update other than $inc needs an explicit undo", i)
    end
    ok, err = check_update(undo, ctx.owned, "undo", i)
    if not ok then return nil, err end
    out.update, out.undo = op.update, undo
  elseif op.update ~= nil or op.undo ~= nil then
    return invalid("only an update op takes update and undo", i)
  end
  if kind == "insert" then
    if type(op.doc) ~= "table" then return invalid("insert needs a doc", i) end
    local doc = {}
    for k, v in pairs(op.doc) do
      if type(k) ~= "string" then return invalid("doc keys are strings", i) end
      if k:sub(1, 1) == "$" then
        return invalid(format("doc may not hold the key %q", k), i)
      end
      for _, field in ipairs(ctx.owned) do
        if k == field then return invalid("doc may not set " .. field, i) end
      end
      doc[k] = v
    end
    if doc._id ~= nil and canon(doc._id) ~= canon(op.id) then
      return invalid("doc._id differs from the op's id", i)
    end
    local op_key = operator_key(doc, 0)
    if op_key then return invalid(format("doc may not hold the key %q", op_key), i) end
    local dotted = dotted_key(doc, 0)
    if dotted then
      return invalid(format("doc may not hold the key %q (dots are paths)", dotted), i)
    end
    local bad = non_finite(doc, 0)
    if bad then return invalid("doc holds " .. tostring(bad), i) end
    doc._id = op.id
    out.doc = doc
  elseif op.doc ~= nil then
    return invalid("only an insert op takes a doc", i)
  end
  return out
end

-- What a transaction's ops may take of its 16 MiB document, leaving the
-- rest to its state, owner, meta and the like.
local MAX_OPS_BYTES = 16 * 1024 * 1024 - 64 * 1024

-- ops: the caller's op list; ctx: { collection = transactions collection
-- name, owned = { "_id", marker, version } }.  Returns the normalised
-- list, or nil, err.
function _M.ops(ops, ctx)
  if type(ops) ~= "table" then error("ops must be a table", 3) end
  if #ops == 0 then return invalid("a transaction needs at least one op") end
  for k in pairs(ops) do
    if type(k) ~= "number" or k < 1 or k > #ops or not is_integer(k) then
      return invalid("ops must be a list")
    end
  end
  local out, seen = {}, {}
  for i, op in ipairs(ops) do
    local norm, err = normalise_op(op, i, ctx)
    if not norm then return nil, err end
    local key = norm.collection .. "\0" .. canon(norm.id, true)
    if seen[key] then
      return invalid(format("document %s of %s is also op %d: one op per " ..
        "document", tostring(norm.id), norm.collection, seen[key]), i)
    end
    seen[key] = i
    out[i] = norm
  end
  -- Too big for one document (or not encodable at all: a table holding
  -- itself, nesting beyond 100 levels) is bad content, found here rather
  -- than as a raise from the insert.  The stored form wraps update, undo
  -- and where in binaries (5 more bytes each), and the transaction's own
  -- fields need room too.
  local ok, bytes = pcall(core.encode, { ops = out })
  if not ok then return invalid("the ops cannot be stored: " .. tostring(bytes)) end
  if #bytes + 15 * #out > MAX_OPS_BYTES then
    return invalid(format("the ops take %d bytes: a transaction is one document of " ..
      "at most 16 MiB", #bytes))
  end
  return out
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
  local _, err = check_collection(op.collection, ctx.collection)
  if err then return err.message end
  _, err = check_id(op.id)
  if err then return err.message end
  if type(op.kind) ~= "string" or not kinds[op.kind] then
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
    _, err = check_update(parts.update, ctx.owned, "update")
    if err then return err.message end
    _, err = check_update(parts.undo, ctx.owned, "undo")
    if err then return err.message end
  end
  if op.kind == "insert" and core.type(op.doc) ~= "object" then
    return "insert without a doc"
  end
  _, err = check_where(parts.where, ctx.owned)
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
