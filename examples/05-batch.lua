-- Many transfers at once: tm:transfer_many runs a whole batch with one
-- round trip per protocol step (insert all transactions pending, apply
-- all ops, commit all, finish all), and an op that cannot apply cancels
-- only its own transaction.  With finish = "deferred" the finishing steps
-- wait and run for many batches together.
--
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/05-batch.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so).  Uses the database mongotx_demo and
-- drops its accounts and transactions collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local show = common.show

local db = common.connect()
common.fresh(db, "accounts")

local accounts = db:collection("accounts")
assert(accounts:insert_many {
  { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 }, { _id = "C", balance = 50 },
})
local tm = assert(db:manager { application = "payroll", finish = "deferred" })

local function counted(fn)
  db.client:reset_counters()
  local a, b = fn()
  local n = db.client:counters()
  return n.commands, n.writes, a, b
end

print("== 3 transfers in one batch; C cannot pay 100 (min = 0)")
local commands, writes, results, errs = counted(function()
  return tm:transfer_many {
    { collection = "accounts", from = "A", to = "B", amount = 100 },
    { collection = "accounts", from = "B", to = "C", amount = 30 },
    { collection = "accounts", from = "C", to = "A", amount = 100, min = 0 },
  }
end)
for i = 1, 3 do
  if results[i] then
    print(string.format("  %d: %s", i, results[i].state))
  else
    print(string.format("  %d: %s", i, tostring(errs[i])))
  end
end
print(string.format("  %d round trips, %d document writes (this first batch also reads the " ..
  "server's clock, and the cancelled transaction goes the one-at-a-time way)", commands, writes))

print("== 3 more that all apply: one round trip per step")
commands, writes = counted(function()
  return tm:transfer_many {
    { collection = "accounts", from = "A", to = "B", amount = 1 },
    { collection = "accounts", from = "B", to = "C", amount = 1 },
    { collection = "accounts", from = "C", to = "A", amount = 1 },
  }
end)
print(string.format("  %d round trips, %d document writes", commands, writes))

print("== the finisher: pull the markers, move them to done")
commands, writes = counted(function() return tm:finish() end)
print(string.format("  %d round trips, %d document writes", commands, writes))

print("== accounts")
for _, d in ipairs(assert(accounts:find_all({}, { sort = { _id = 1 } }))) do print("  " .. show(d)) end
print("== transactions by state: " .. show(assert(tm:stats())))
