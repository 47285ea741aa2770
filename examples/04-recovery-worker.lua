-- A recovery worker: finds transactions left unfinished (their owner
-- crashed or stalled) and drives each one to done or cancelled under a
-- policy of its own:
--   stale_after = 5        a transaction untouched for 5 s counts as stale
--   stale_pending          a stale pending transaction rolls forward when
--                          its meta.priority is "high", back otherwise
--   on_event               prints every step the worker takes
--   max_attempts = 3       after 3 failed recoveries a transaction is parked
--
--   lua5.4 examples/04-recovery-worker.lua          the demo: leaves two
--       transfers pending by hand (a crashed owner), then runs one
--       recovery pass with stale_after = 0 and lease = 0, so it need not
--       wait, and prints the report
--   lua5.4 examples/04-recovery-worker.lua --loop   a worker: no demo set-up
--       (nothing dropped), the policy above with the default lease; runs
--       tm:recover() every 5 seconds until interrupted
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so); MONGOTX_TEST_URI is the server
-- (default mongodb://127.0.0.1:27017).  Uses the database mongotx_demo;
-- the demo drops its accounts and transactions collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local mongotx, show = common.mongotx, common.show

local db = common.connect()

local loop = arg[1] == "--loop"
if arg[1] ~= nil and not loop then
  io.stderr:write("usage: lua5.4 examples/04-recovery-worker.lua [--loop]\n")
  os.exit(2)
end

local policy = {
  stale_after = 5,
  stale_pending = function(tx)
    return tx.meta and tx.meta.priority == "high" and "forward" or "back"
  end,
  on_event = function(name, info)
    if name == "recover" then return end -- the report is printed below
    local res = info.result
    local extra = ""
    if type(res) == "table" and res.state then -- a claim returns the claimed document
      extra = (" -> %s, owner %s, epoch %s"):format(res.state, res.application, res.epoch)
    elseif res ~= nil then
      extra = " " .. show(res)
    end
    if info.reason then extra = extra .. " reason " .. tostring(info.reason) end
    print(("    event %s, transaction %s%s"):format(name, show(info.id), extra))
  end,
  max_attempts = 3,
}

local heading = common.heading

local function print_report(report)
  print(("  examined %d, done %d, cancelled %d, skipped %d, parked %d, failed %d"):format(
    report.examined, report.done, report.cancelled, report.skipped, report.parked,
    report.failed))
  for _, e in ipairs(report.errors) do
    print(("  error on %s: %s"):format(show(e.id), tostring(e.error)))
  end
end

if loop then
  local opts = { application = "recovery-worker" }
  for k, v in pairs(policy) do opts[k] = v end
  local tm = assert(db:manager(opts))
  print("recovery worker: a pass every 5 seconds (interrupt to stop)")
  while true do
    local report, err = tm:recover()
    if report then
      io.write(os.date("!%H:%M:%S "))
      print_report(report)
    else
      print("recovery pass failed: " .. tostring(err))
    end
    mongotx.core.sleep(5)
  end
end

common.fresh(db, "accounts")
local accounts = db:collection("accounts")

local function balances()
  local docs = assert(accounts:find_all({}, { sort = { _id = 1 } }))
  for _, d in ipairs(docs) do
    print(("  %s: balance %d, pendingTransactions %s"):format(d._id, d.balance,
      show(d.pendingTransactions)))
  end
end

heading("accounts A and B with 1000 each")
assert(accounts:insert_many({
  { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
  { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
}))
balances()

-- The crashed owner: lease = 0, so others may take its transactions over
-- at once.  It claims each transfer and applies op 1 only, then "dies".
local web = assert(db:manager{ application = "web-1", lease = 0 })
local function half_done(id, amount, priority)
  local t = assert(web:begin({
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -amount } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = amount } } },
  }, { id = id, meta = { priority = priority } }))
  assert(web:step("claim", t))
  assert(web:step("apply", t, 1))
  return t
end

heading("web-1 starts two transfers from A to B, applies op 1 of each, and crashes")
half_done("urgent", 100, "high")
half_done("routine", 10, "low")
for _, T in ipairs(assert(web:find({}, { sort = { _id = 1 } }))) do
  print(("  transaction %s: state %s, owner %s, meta.priority %s"):format(
    show(T._id), T.state, T.application, T.meta.priority))
end
balances()

heading("one recovery pass by \"recovery-worker\" (stale_after = 0, lease = 0 for the demo)")
local opts = { application = "recovery-worker" }
for k, v in pairs(policy) do opts[k] = v end
opts.stale_after, opts.lease = 0, 0
local tm = assert(db:manager(opts))
local report = assert(tm:recover())
print("  report:")
print_report(report)
assert(report.examined == 2 and report.done == 1 and report.cancelled == 1
       and report.failed == 0, "unexpected recovery report")

heading("afterwards")
for _, T in ipairs(assert(tm:find({}, { sort = { _id = 1 } }))) do
  print(("  transaction %s: state %s, owner %s, epoch %d%s"):format(show(T._id), T.state,
    T.application, T.epoch, T.reason and ", reason " .. T.reason or ""))
end
balances()
assert(tm:get("urgent").state == "done" and tm:get("routine").state == "cancelled")
local A = assert(accounts:find_one({ _id = "A" }))
local B = assert(accounts:find_one({ _id = "B" }))
assert(A.balance == 900 and B.balance == 1100, "only the urgent transfer should remain")
assert(#A.pendingTransactions == 0 and #B.pendingTransactions == 0)
db:close()
