-- The seed's tutorial (MongoDB's "Perform Two Phase Commits"), now through
-- the mongotx engine: accounts A and B, a transfer of 100 walked one
-- protocol step at a time with tm:step, printing the transaction and both
-- accounts after every step; then the same transfer in one call
-- (tm:transfer), then an overdraft that the engine cancels.  B's credit
-- waits in B's txPending until its finish (escrow: docs/guards.md), so
-- that no guard can spend it before the transaction commits.
--
--   make demo                      starts a test server and runs 00 and this
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/01-tutorial.lua
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
local tm = assert(db:manager{ application = "tutorial" })

local heading = common.heading

local function account(id)
  return assert(accounts:find_one({ _id = id }))
end

-- The transaction's state and lastModified, then both accounts.
local function report(id)
  local T = assert(tm:get(id))
  print(("  transaction %s: state %s, lastModified %s"):format(
    show(T._id), T.state, show(T.lastModified)))
  for _, name in ipairs { "A", "B" } do
    local a = account(name)
    print(("  account %s: balance %d, pendingTransactions %s%s"):format(
      name, a.balance, show(a.pendingTransactions),
      a.txPending and ", txPending " .. show(a.txPending) or ""))
  end
  return T
end

-- lastModified has millisecond resolution: pause a little between steps
-- so that each transition shows a later time.
local function tick() mongotx.core.sleep(0.01) end

heading("accounts A and B, as the tutorial creates them")
assert(accounts:insert_many({
  { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
  { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
}))
for _, name in ipairs { "A", "B" } do print("  " .. show(account(name))) end

heading("begin: a transfer of 100 from A to B (transaction id 1), state initial")
local t = assert(tm:begin({
  { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } },
  { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 100 } } },
}, { id = 1 }))
local T = report(1)
assert(T.state == "initial")
print("  ops stored with their undo: " .. show(T.ops[1]))

local steps = {
  { "claim", nil, "claim: initial -> pending, this manager is the owner", "pending", 1000, 1000 },
  { "apply", 1, "apply op 1: A's balance -100, the transaction's id pushed on A", "pending", 900, 1000 },
  { "apply", 2, "apply op 2: B's credit of 100 into B's txPending, the transaction's id pushed on B",
    "pending", 900, 1000 },
  { "commit", nil, "commit: pending -> applied (the commit point)", "applied", 900, 1000 },
  { "finish", 1, "finish op 1: pull the id from A's pendingTransactions", "applied", 900, 1000 },
  { "finish", 2, "finish op 2: pull the id from B's pendingTransactions, the credit moved into " ..
    "B's balance", "applied", 900, 1100 },
  { "done", nil, "done: applied -> done", "done", 900, 1100 },
}
for _, s in ipairs(steps) do
  local name, i, text, state, a, b = s[1], s[2], s[3], s[4], s[5], s[6]
  tick()
  heading(("tm:step(%q, t%s): %s"):format(name, i and ", " .. i or "", text))
  local res = assert(tm:step(name, t, i))
  if name ~= "claim" then print("  result: " .. show(res)) end
  if name == "apply" then
    -- the marker makes an apply safe to repeat: the second one changes nothing
    print("  applied again: " .. show(assert(tm:step(name, t, i))) .. " (already there)")
  end
  T = report(1)
  assert(T.state == state, "expected state " .. state)
  assert(account("A").balance == a and account("B").balance == b, "unexpected balances")
end

heading("repeating a step changes nothing")
print("  done again: " .. show(assert(tm:step("done", t))) .. " (nothing matched)")
print("  finish op 1 again: " .. show(assert(tm:step("finish", t, 1))) .. " (no marker left)")
report(1)
assert(account("A").balance == 900)

heading("tm:transfer(\"accounts\", \"A\", \"B\", 100): the same seven steps in one call")
local done = assert(tm:transfer("accounts", "A", "B", 100))
print(("  transaction %s: state %s, source %s, destination %s, value %d"):format(
  show(done._id), done.state, done.source, done.destination, done.value))
report(done._id)
assert(done.state == "done")
assert(account("A").balance == 800 and account("B").balance == 1200)

heading("an overdraft: 5000 from A with { min = 0 } (A has 800)")
local ok, err = tm:transfer("accounts", "A", "B", 5000, { min = 0 })
assert(ok == nil and err, "the overdraft should fail")
print("  tm:transfer returned nil and err: " .. tostring(err))
print(("  err.code %s, err.step %s, err.op %s"):format(err.code, tostring(err.step),
  tostring(err.op)))
T = report(err.id)
print("  reason recorded on the transaction: " .. tostring(T.reason))
assert(T.state == "cancelled")
assert(account("A").balance == 800 and account("B").balance == 1200, "balances changed")
assert(#account("A").pendingTransactions == 0 and #account("B").pendingTransactions == 0)

heading("tm:stats()")
print("  " .. show(assert(tm:stats())))
db:close()
