-- Checks and normalises what callers pass in, before anything is written
-- (DESIGN.md §8).  Wrong argument types are programming errors and raise;
-- bad content returns nil and an `invalid` error saying which op and why.
-- Caller data never becomes a query operator: ids and inserted documents
-- may not hold `$` keys, and the fields mongotx owns are off limits.

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
-- the table's keys: used to compare ids and ops across processes.
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

-- The first key starting with `$` anywhere in v, or nil.
local function operator_key(v, depth)
  if type(v) ~= "table" or depth > 100 then return nil end
  for k, x in pairs(v) do
    if type(k) == "string" and k:sub(1, 1) == "$" then return k end
    local found = operator_key(x, depth + 1)
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
      if type(path) ~= "string" or path == "" or path:sub(1, 1) == "$" then
        return invalid(format("%s: %s has a bad field name %s", what, opname,
          tostring(path)), i)
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
    if k == "_id" then return invalid("where may not constrain _id", i) end
    for _, field in ipairs(owned) do
      if touches(k, field) then
        return invalid("where may not constrain " .. field, i)
      end
    end
  end
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
    local bad = non_finite(doc, 0)
    if bad then return invalid("doc holds " .. tostring(bad), i) end
    doc._id = op.id
    out.doc = doc
  elseif op.doc ~= nil then
    return invalid("only an insert op takes a doc", i)
  end
  return out
end

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
    local key = norm.collection .. "\0" .. canon(norm.id)
    if seen[key] then
      return invalid(format("document %s of %s is also op %d: one op per " ..
        "document", tostring(norm.id), norm.collection, seen[key]), i)
    end
    seen[key] = i
    out[i] = norm
  end
  return out
end

-- Raises unless every key of opts is listed in names.
function _M.options(opts, names, what, level)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(what .. " must be a table", level + 1) end
  for k in pairs(opts) do
    if not names[k] then
      error(format("unknown option %s for %s", tostring(k), what), level + 1)
    end
  end
  return opts
end

function _M.amount(amount)
  if type(amount) ~= "number" then error("amount must be a number", 3) end
  if not finite(amount) then
    return invalid("amount must be finite, not " .. tostring(amount))
  end
  if amount <= 0 then return invalid("amount must be positive") end
  return true
end

return _M
