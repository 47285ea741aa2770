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

package.path = "./examples/?.lua;" .. package.path
local common = require "common" -- module paths, and the printer
local show, heading = common.show, common.heading
local core = require "mongotx.core"

local uri, DB = common.URI, common.DATABASE

local function check(ok, err, ...)
  if ok == nil and err ~= nil then
    io.stderr:write("00-accounts: ", tostring(err), "\n")
    os.exit(1)
  end
  return ok, err, ...
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
}))
print_accounts(accounts)

heading("insert_one: a transaction document in state initial")
-- core.doc keeps the keys in this order (a plain table's order is Lua's).
local txn = core.doc("_id", 1, "source", "A", "destination", "B", "value", 100,
                     "state", "initial", "lastModified", core.Date())
check(transactions:insert_one(txn))
print("  " .. show(check(transactions:find_one({ _id = 1 }))))

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
    { ["$inc"] = { balance = delta }, ["$push"] = { pendingTransactions = txn._id } }))
  print(("  %s: matched %d, modified %d (balance %+d)"):format(id, r.matched, r.modified, delta))
end
-- Applying again matches nothing: the marker makes the step safe to repeat.
local again = check(accounts:update_one(
  { _id = txn.source, pendingTransactions = { ["$ne"] = txn._id } },
  { ["$inc"] = { balance = -txn.value }, ["$push"] = { pendingTransactions = txn._id } }))
print(("  A again: matched %d (already applied, nothing changes)"):format(again.matched))
print_accounts(accounts)

heading("commit, remove the markers, done")
check(transactions:update_one({ _id = txn._id, state = "pending" },
  { ["$set"] = { state = "applied" }, ["$currentDate"] = { lastModified = true } }))
for _, id in ipairs { txn.source, txn.destination } do
  check(accounts:update_one({ _id = id, pendingTransactions = txn._id },
                            { ["$pull"] = { pendingTransactions = txn._id } }))
end
check(transactions:update_one({ _id = txn._id, state = "applied" },
  { ["$set"] = { state = "done" }, ["$currentDate"] = { lastModified = true } }))

heading("afterwards")
print_accounts(accounts)
print("  " .. show(check(transactions:find_one({ _id = txn._id }))))

client:close()
