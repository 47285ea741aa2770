-- Compensation: a committed transfer cannot be rolled back (`applied` is
-- the commit point), but it can be undone by a second transaction with
-- the inverse ops, linked to the first by `compensates`.  Its id derives
-- from the original's, so calling tm:compensate twice (or from two
-- processes) still creates exactly one.
--
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/03-compensation.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so).  Uses the database mongotx_demo and
-- drops its accounts and transactions collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local mongotx, show = common.mongotx, common.show

local db = common.connect()
common.fresh(db, "accounts")

local accounts = db:collection("accounts")
local tm = assert(db:manager{ application = "bank" })

local heading = common.heading

local function balances()
  local A = assert(accounts:find_one({ _id = "A" }))
  local B = assert(accounts:find_one({ _id = "B" }))
  print(("  A: %d, B: %d"):format(A.balance, B.balance))
  return A.balance, B.balance
end

heading("accounts A and B with 1000 each")
assert(accounts:insert_many({
  { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
  { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
}))
balances()

heading("transfer 100 from A to B (id \"pay-42\")")
local t = assert(tm:transfer("accounts", "A", "B", 100, { id = "pay-42" }))
print("  transaction " .. show(t._id) .. " ended " .. t.state)
local a, b = balances()
assert(t.state == "done" and a == 900 and b == 1100)

heading("rollback is refused: the transfer is committed")
local ok, err = tm:rollback(t)
assert(ok == nil and err.code == "state")
print("  " .. tostring(err))

heading("tm:compensate(t): a new transaction with the inverse ops")
local c1 = assert(tm:compensate(t))
print(("  compensating transaction %s ended %s, compensates %s"):format(
  show(c1._id), c1.state, show(c1.compensates)))
for i, op in ipairs(c1.ops) do print(("  op %d: %s"):format(i, show(op))) end
a, b = balances()
assert(c1.state == "done" and a == 1000 and b == 1000)

heading("tm:compensate(t) again: the same compensating transaction, nothing moves")
local c2 = assert(tm:compensate(t))
print(("  compensating transaction %s, state %s"):format(show(c2._id), c2.state))
a, b = balances()
assert(mongotx.encode({ v = c1._id }) == mongotx.encode({ v = c2._id }))
assert(a == 1000 and b == 1000)

heading("the transactions collection")
local all = assert(tm:find({}, { sort = { lastModified = 1 } }))
for _, T in ipairs(all) do
  print(("  %s: state %s%s"):format(show(T._id), T.state,
    T.compensates and ", compensates " .. show(T.compensates) or ""))
end
local comp = assert(tm:find({ compensates = "pay-42" }))
print(("  %d transaction compensates \"pay-42\""):format(#comp))
assert(#all == 2 and #comp == 1)
db:close()
