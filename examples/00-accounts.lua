-- The foundation on its own: mongotx.core (the C module) talking to MongoDB,
-- with the accounts of the two-phase-commit tutorial.  No transaction
-- engine here: this walks a transfer of 100 from A to B by hand, one
-- single-document write at a time, the way the tutorial does.
--
--   make demo                      starts a test server and runs this
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/00-accounts.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (the Makefile sets it; default ./build/lua54/?.so).

local cpath = os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so"
package.cpath = cpath .. ";" .. package.cpath
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path

local core = require "mongotx.core"

local uri = os.getenv("MONGOTX_TEST_URI") or "mongodb://127.0.0.1:27017"
local DB = "mongotx_demo"
-- Passed where the options argument is optional: mongotx.core 0.1.0 reads
-- an omitted trailing options argument from the wrong stack slot (see the
-- README's known issues); an explicit empty table avoids it.
local NO_OPTIONS = {}

-- A value as the mongo shell would print it, keys in stored order.
local function show(v)
  if v == core.null then return "null" end
  local t = type(v)
  if t == "string" then return string.format("%q", v) end
  if t ~= "table" then return tostring(v) end
  local mt = getmetatable(v)
  local parts = {}
  if (mt and mt.__mongotx == "array") or (not mt and #v > 0) then
    for i = 1, #v do parts[i] = show(v[i]) end
    return "[" .. table.concat(parts, ", ") .. "]"
  end
  local keys, seen = {}, {}
  if v._id ~= nil then keys[1], seen._id = "_id", true end
  for _, k in ipairs(mt or {}) do
    if not seen[k] and v[k] ~= nil then keys[#keys + 1], seen[k] = k, true end
  end
  local rest = {}
  for k in pairs(v) do
    if not seen[k] then rest[#rest + 1] = tostring(k) end
  end
  table.sort(rest)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  for i, k in ipairs(keys) do parts[i] = k .. ": " .. show(v[k]) end
  return "{ " .. table.concat(parts, ", ") .. " }"
end

local function check(ok, err, ...)
  if ok == nil and err ~= nil then
    io.stderr:write("00-accounts: ", tostring(err), "\n")
    os.exit(1)
  end
  return ok, err, ...
end

local function heading(text)
  print()
  print("== " .. text)
end

local function print_accounts(accounts)
  for _, doc in ipairs(check(accounts:find_all({}, { sort = { _id = 1 } }))) do
    print("  " .. show(doc))
  end
end

print(("mongotx.core %s, server %s, database %s"):format(core._VERSION, uri, DB))
local client = check(core.connect(uri))
local accounts = client:collection(DB, "accounts")
local transactions = client:collection(DB, "transactions")

heading("accounts A and B, as the tutorial creates them")
check(accounts:drop())
check(transactions:drop())
check(accounts:insert_many({
  { _id = "A", balance = 1000, pendingTransactions = core.array() },
  { _id = "B", balance = 1000, pendingTransactions = core.array() },
}, NO_OPTIONS))
print_accounts(accounts)

heading("insert_one: a transaction document in state initial")
-- core.doc keeps the keys in this order (a plain table's order is Lua's).
local txn = core.doc("_id", 1, "source", "A", "destination", "B", "value", 100,
                     "state", "initial", "lastModified", core.Date())
check(transactions:insert_one(txn, NO_OPTIONS))
print("  " .. show(check(transactions:find_one({ _id = 1 }, NO_OPTIONS))))

heading("find: accounts with a balance of at least 1000 (a cursor)")
local cursor = accounts:find({ balance = { ["$gte"] = 1000 } },
                             { sort = { _id = 1 }, projection = { balance = 1 } })
for doc in function() return check(cursor:next()) end do
  print("  " .. show(doc))
end
cursor:close()

heading("find_and_modify: claim the transaction (initial -> pending)")
local claimed = check(transactions:find_and_modify({ state = "initial" }, {
  update = { ["$set"] = { state = "pending" },
             ["$currentDate"] = { lastModified = true } },
  new = true,
}))
txn = claimed.value
print("  " .. show(txn))

heading("update_one with $inc: apply to A and B, each guarded by the marker")
for _, step in ipairs { { txn.source, -txn.value }, { txn.destination, txn.value } } do
  local id, delta = step[1], step[2]
  local r = check(accounts:update_one(
    { _id = id, pendingTransactions = { ["$ne"] = txn._id } },
    { ["$inc"] = { balance = delta }, ["$push"] = { pendingTransactions = txn._id } },
    NO_OPTIONS))
  print(("  %s: matched %d, modified %d (balance %+d)"):format(id, r.matched, r.modified, delta))
end
-- Applying again matches nothing: the marker makes the step safe to repeat.
local again = check(accounts:update_one(
  { _id = txn.source, pendingTransactions = { ["$ne"] = txn._id } },
  { ["$inc"] = { balance = -txn.value }, ["$push"] = { pendingTransactions = txn._id } },
  NO_OPTIONS))
print(("  A again: matched %d (already applied, nothing changes)"):format(again.matched))
print_accounts(accounts)

heading("commit, remove the markers, done")
check(transactions:update_one({ _id = txn._id, state = "pending" },
  { ["$set"] = { state = "applied" }, ["$currentDate"] = { lastModified = true } }, NO_OPTIONS))
for _, id in ipairs { txn.source, txn.destination } do
  check(accounts:update_one({ _id = id, pendingTransactions = txn._id },
                            { ["$pull"] = { pendingTransactions = txn._id } }, NO_OPTIONS))
end
check(transactions:update_one({ _id = txn._id, state = "applied" },
  { ["$set"] = { state = "done" }, ["$currentDate"] = { lastModified = true } }, NO_OPTIONS))

heading("afterwards")
print_accounts(accounts)
print("  " .. show(check(transactions:find_one({ _id = txn._id }, NO_OPTIONS))))

client:close()
