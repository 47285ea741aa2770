-- How a transaction and its markers look in the database: shared by the
-- manager (lua/mongotx/manager.lua) and the batched protocol
-- (lua/mongotx/batch.lua).
--
-- A transaction's mark is what its applies push into the marker array
-- (and `txHeld`, `txRemoving`, a fence's placeholder): what names it on a
-- document, so it must be unique across transactions collections.  In
-- the `transactions` collection (the tutorial's) it is the transaction's
-- _id, so that a writer following the tutorial's recipe finds it there;
-- in any other collection a string naming the collection and the _id
-- (new_mark), recorded in the transaction as `mark`.  A transaction also records
-- the marker and version fields it was begun with (`markerField`,
-- `versionField`): whoever drives it uses those (Engine:form), not its
-- own options.  One an older build stored records none of them: its mark
-- is its _id and its fields are the driving manager's, as then.

local core = require "mongotx.core"

local ipairs, pairs, next, type, tonumber = ipairs, pairs, next, type, tonumber
local format, char = string.format, string.char
local core_id_key = core.id_key

local _M = {}

-- The condition on `ops` of the documents mongotx wrote: every
-- transaction it creates has its ops.  A document without (one of another
-- writer sharing the collection, such as a service following the
-- tutorial's recipe with its default names) is foreign: recovery, the
-- counts and prune leave it alone, and tm:backlog() counts it apart.
_M.OWN = { ["$exists"] = true }

-- The key of an id read back from the database (a marker, a stored op's
-- id), or nil when it is no valid id: equal to validate.check_id's for
-- the same _id.  (Here rather than in mongotx.validate, which sits above
-- this module: it stores the ops it checks.)
local function id_key(id) return (core_id_key(id)) end
_M.id_key = id_key


-- The collection whose transactions are marked with their _id.
local HOME = "transactions"
_M.HOME = HOME
-- What every other mark starts with; no transaction id may
-- (validate.check_tid), so no mark of one collection is another's.
local MARK_PREFIX = "$mongotx:"
_M.MARK_PREFIX = MARK_PREFIX

-- Fields mongotx keeps on the documents it touches besides the marker and
-- the version (both named by the manager's options):
-- set by the remove op of an open transaction (its id): no other op
-- applies to the document meanwhile;
local REMOVING = "txRemoving"
-- the open transactions whose effect on a document may have raised a
-- value: a floor guard waits for them;
local HELD = "txHeld"
-- set (to the transaction's id) on the placeholder a rolled-back takeover
-- leaves where an insert op would have put its document, so that an
-- insert a stalled former owner prepared cannot land (fence); prune()
-- removes it with the transaction.
local PLACEHOLDER = "txPlaceholder"
-- the escrowed credits of the open transactions on a document, by path
-- ({ balance = 30 }): moved into their fields at the finish, taken back
-- at the undo (docs/guards.md, "Escrow").
local PENDING = "txPending"
-- the open transactions with an escrowed credit in txPending, whatever
-- their marker field: any manager's floor guard finishes the committed
-- ones first, so that it reads their credit (docs/guards.md, "Escrow").
local ESCROW = "txEscrow"
_M.REMOVING, _M.HELD, _M.PLACEHOLDER, _M.PENDING, _M.ESCROW =
  REMOVING, HELD, PLACEHOLDER, PENDING, ESCROW

-- The mark a new transaction of collection `coll` with this _id records
-- (nil: none, its _id is its mark): MARK_PREFIX, the collection's name, a
-- `$` (which no collection name holds) and the hex of the BSON of { i =
-- id }.  Distinct transactions have distinct marks: their collections or
-- their ids differ, and so do the BSON of distinct ids.  (A string: a
-- Binary's subtype does not survive mongo-java-server, and FerretDB
-- cannot $pull a document.)
local function hex_byte(c) return format("%02x", c:byte()) end
function _M.new_mark(coll, id)
  if coll == HOME then return nil end
  local bson = core.encode({ i = id })
  return MARK_PREFIX .. coll .. "$" .. bson:gsub(".", hex_byte)
end

-- T's mark (see above).
function _M.mark(T)
  local m = T.mark
  if m == nil then return T._id end
  return m
end

-- The transactions collection and _id a mark names; nil, id for a bare
-- _id (the mark of `transactions`, or of an older build's transaction in
-- any collection); nil for a mark that is not well formed.
function _M.named(mark)
  if type(mark) ~= "string" or mark:sub(1, #MARK_PREFIX) ~= MARK_PREFIX then
    return nil, mark
  end
  local coll, hex = mark:match("^([^$]+)%$(%x+)$", #MARK_PREFIX + 1)
  if not coll or #hex % 2 == 1 then return nil end
  local ok, doc = pcall(core.decode, (hex:gsub("%x%x", function(h)
    return char(tonumber(h, 16))
  end)))
  if not ok or type(doc) ~= "table" or doc.i == nil then return nil end
  return coll, doc.i
end

-- An op's update, undo and where hold `$` keys, which servers refuse in a
-- stored document (MongoDB before 5.0, FerretDB): the transaction keeps
-- them as BSON inside a Binary, and loading turns them back into tables.
local OPERATOR_FIELDS = { "update", "undo", "where" }

-- Is where a floor (only $gte / $gt of numbers on fields)?  A floor may
-- read values that uncommitted debits have lowered (csrc/txn.h, "Guards").
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
