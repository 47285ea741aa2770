-- How a transaction and its markers look in the database: shared by the
-- manager (lua/mongotx/manager.lua) and the batched protocol
-- (lua/mongotx/batch.lua).

local core = require "mongotx.core"

local ipairs, pairs, next, type = ipairs, pairs, next, type
local core_id_key = core.id_key

local _M = {}

-- The key of an id read back from the database (a marker, a stored op's
-- id), or nil when it is no valid id: equal to validate.check_id's for
-- the same _id.  (Here rather than in mongotx.validate, which sits above
-- this module: it stores the ops it checks.)
local function id_key(id) return (core_id_key(id)) end
_M.id_key = id_key


-- An op's update, undo and where hold `$` keys, which servers refuse in a
-- stored document (MongoDB before 5.0, FerretDB): the transaction keeps
-- them as BSON inside a Binary, and loading turns them back into tables.
local OPERATOR_FIELDS = { "update", "undo", "where" }

-- Is where a floor (only $gte / $gt of numbers on fields)?  A floor may
-- read values that uncommitted debits have lowered (csrc/txn.c, "Guards").
function _M.is_floor(where)
  if type(where) ~= "table" or next(where) == nil then return false end
  for field, cond in pairs(where) do
    if type(field) ~= "string" or field:byte(1) == 36 or type(cond) ~= "table"
        or next(cond) == nil then
      return false
    end
    for opname, bound in pairs(cond) do
      if (opname ~= "$gte" and opname ~= "$gt") or type(bound) ~= "number" then return false end
    end
  end
  return true
end
local is_floor = _M.is_floor

-- The ops as they are stored (a mongotx.Value holding the array, sent as
-- it is) and their size in bytes, built in C in one pass (csrc/stored.c;
-- `floor` is derived again on loading).  encoded[i], when given, holds op
-- i's operator fields already encoded (validate.ops keeps the BSON its
-- snapshots made), so that no op is encoded twice.  Raises when the ops
-- cannot be encoded.
_M.ops = core.stored_ops

-- Decodes the operator fields of T's ops in place, and marks the floor
-- guards; T as it was when they are not binaries (a malformed document is
-- left for validate.malformed).
function _M.live(T)
  if type(T) ~= "table" or type(T.ops) ~= "table" then return T end
  for _, op in ipairs(T.ops) do
    if type(op) == "table" then
      for _, f in ipairs(OPERATOR_FIELDS) do
        if core.type(op[f]) == "binData" then
          op[f] = core.decode((op[f]:value()))
        end
      end
      op.floor = is_floor(op.where) or nil
    end
  end
  return T
end

-- Does doc carry transaction id's marker in its `marker` array?  Ids
-- compare as the server compares them (1 and 1.0 are one id).
function _M.has_marker(doc, marker, id)
  local list = doc and doc[marker]
  if type(list) ~= "table" then return false end
  local k = id_key(id)
  for _, x in ipairs(list) do
    if id_key(x) == k then return true end
  end
  return false
end

-- The markers on doc of transactions other than id: the transactions
-- that hold the document (an empty list when none does).
function _M.holders(doc, marker, id)
  local list, out = doc and doc[marker], {}
  if type(list) ~= "table" then return out end
  local k = id_key(id)
  for _, x in ipairs(list) do
    if id_key(x) ~= k then out[#out + 1] = x end
  end
  return out
end

return _M
