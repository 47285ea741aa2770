-- How a transaction and its markers look in the database: shared by the
-- manager (lua/mongotx/manager.lua) and the batched protocol
-- (lua/mongotx/batch.lua).

local core = require "mongotx.core"
local validate = require "mongotx.validate"
local id_key, is_floor = validate.id_key, validate.is_floor

local ipairs, pairs, type = ipairs, pairs, type

local _M = {}

-- An op's update, undo and where hold `$` keys, which servers refuse in a
-- stored document (MongoDB before 5.0, FerretDB): the transaction keeps
-- them as BSON inside a Binary, and loading turns them back into tables.
local OPERATOR_FIELDS = { "update", "undo", "where" }

-- The ops as they are stored (`floor` is derived again on loading).
function _M.ops(ops)
  local out = {}
  for i, op in ipairs(ops) do
    local s = {}
    for k, v in pairs(op) do s[k] = v end
    for _, f in ipairs(OPERATOR_FIELDS) do
      if op[f] ~= nil then s[f] = core.Binary(core.encode(op[f])) end
    end
    s.floor = nil
    out[i] = s
  end
  return out
end

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
